"""What every adapter shares, whatever the framework: the options, defined once (:mod:`.options`,
``AuditOptions``), the adapters' own arguments checked (:mod:`.arguments`), the lifecycle of an audit inside
a trainer (:mod:`.trainer_session`: open, step aside, cadence, trainable-set watch, checkpoints), the runner
that audits, acts and reports (:mod:`.runner`), the overlapped audit's driver (:mod:`.overlap`), and the
history handed back from worker processes (:mod:`.worker_history`). It imports no framework.
"""
