"""The round (`engine`) and the live full-information evaluator (`evaluation`): they sit
above the drafters they drive. Token ids only; no text, no printing."""
