"""Plan and write: the output plan, the one file-writing engine, atomic folders and durability, and the executors
(forked writers, torchrun ranks, the head start)."""
