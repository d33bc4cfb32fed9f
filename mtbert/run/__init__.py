"""One trial's state (``TrialRun``) and what sits beside it: its evaluation, its
checkpoints and their files, a model's predictions and their files, the metrics, the
ensemble, an exported model.  No step engine here: the engines above step a trial's
state, and the loop above them (:mod:`mtbert.loop`) drives both."""
