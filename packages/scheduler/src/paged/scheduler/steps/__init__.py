"""Steps composed by `Scheduler.schedule()`: running, waiting, preemption, encoder, output."""
