"""Attribution: which rank is wrong, and whether it is the machine, told even between two replicas.

A vote needs a majority; two replicas never have one. Each rank's own timeline does: between two
optimizer steps its parameters and optimizer state must not change (:mod:`.watch`, at rest); from the
same reduced gradients and the same pre-step state every rank's update must give the same bytes, and
each rank can replay its own (:mod:`.replay`); the reduced gradient buckets must be equal everywhere
(:mod:`.collective`). Each rank records these locally, without a message, and only an audit that found
a divergence exchanges the records (:mod:`.settle`) and decides, from the same gathered data on every
rank, whom to blame and why (:mod:`.blame`).
"""
