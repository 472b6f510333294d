"""polyrl's local engine: the Tinker client interface served in-process by PyTorch + PEFT."""

from polyrl.local.rest import RestClient
from polyrl.local.service import SamplingClient, ServiceClient, TrainingClient

__all__ = ["ServiceClient", "TrainingClient", "SamplingClient", "RestClient"]
