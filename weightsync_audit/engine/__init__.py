"""The engine, one folder per phase of an audit: what is audited (``inventory``), how it is hashed
(``hashing``), how ranks agree (``agreement``), how far apart they are (``measure``), why (``explain``),
when they parted (``timeline``), how replicas are made equal again (``repair``) and trusted across
restarts (``checkpoints``); ``auditor`` and ``run`` on top, ``respond`` for what a result leads to."""
