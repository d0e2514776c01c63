from .configuration_dflash import DFlashConfig
from .modeling_dflash import DFlashDraftModel

__all__ = ["DFlashConfig", "DFlashDraftModel"]
