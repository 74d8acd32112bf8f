"""One prompt through the engine, as a user sees it: chat template and token ids in,
streamed text (incremental detokenization, stop strings) and statistics out."""
