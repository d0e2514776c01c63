from .configuration_eagle3 import Eagle3Config
from .modeling_eagle3 import Eagle3DraftModel, Eagle3Output

__all__ = ["Eagle3Config", "Eagle3DraftModel", "Eagle3Output"]
