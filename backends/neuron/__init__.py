"""AWS Neuron backend: the XLA static-shape runner shared with tpu, on NeuronCores."""
from .backend import NeuronBackend

__all__ = ["NeuronBackend"]
