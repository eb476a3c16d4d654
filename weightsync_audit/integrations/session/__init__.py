"""What every adapter shares, whatever the framework: its arguments checked (:mod:`.arguments`), the
runner that audits, acts and reports (:mod:`.runner`), the overlapped audit's driver (:mod:`.overlap`),
and the history handed back from worker processes (:mod:`.worker_history`). It imports no framework.
"""
