"""Operation classes of the seeds' "Anatomy of Model's Operations", shared by prediction and profiling."""
