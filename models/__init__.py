"""Reference PyTorch models: one readable file per model, one shared attention, one registry.

`xdeploy.models.spec` is torch-free (the lean serving environment reads artifacts without torch); the
registry and the models import torch, so they are imported from their modules, not here."""
