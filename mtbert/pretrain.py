"""Pre-training stages run before multitask fine-tuning. Filled in by the techniques issue."""


def run_pretraining(cfg, data, model, device, log=print) -> None:
    raise NotImplementedError(f"pretrain={cfg.pretrain} is not implemented yet")
