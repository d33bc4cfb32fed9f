"""One trial, as a Ray worker runs it: its config (the base merged with what the searcher
sampled), the objective it is scored on and what its reports carry, its work folder, how
far each of its runs trained, the function trainable around the Trainer, and its worker's
exit.  No Ray at import; the bottom of the search's layers."""
