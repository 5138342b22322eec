"""What shapes a trace (its key, the code digest) and where traces come from: the in-memory and
on-disk cache, forked workers, or this process."""
