"""What every adapter shares, whatever the framework: the options, defined once, and the adapters' own
arguments checked (:mod:`.options`, ``AuditOptions``), the lifecycle of an audit inside a trainer
(:mod:`.trainer_session`: open, step aside, cadence, trainable-set watch, checkpoints, the run's summary, also
from worker processes), the runner that audits, acts and reports, and the overlapped audit's driver
(:mod:`.runner`). It imports no framework.
"""
