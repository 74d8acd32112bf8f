"""The decode core's pure tensor functions, below the models and the drafters that use
them: sampling transforms (`sampling`), lossless verification (`verify`) and the
device-aware stopwatch (`stopwatch`). No model, no drafter, no policy."""
