"""The lean forward: a Llama-family decode step without transformers' per-op overhead (the target's and small drafters') and a token tree's rows as it reads them."""
