"""What is audited (manifest), how it is hashed (digest, device_digest, sampling, hostbytes), how ranks
agree (consensus), how large a gap is (gaps), and the phases that tie them together (auditor, resync)."""
