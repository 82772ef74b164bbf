"""The worker side: one worker's loop, scheduler, sequences, runners, sampling and output (its own process, or a thread)."""
