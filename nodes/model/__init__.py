"""The model description shared by both sides: spec, tensor index, fingerprint."""

from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.fingerprint import fingerprint
from tandem.nodes.model.index import ModelIndex, TensorEntry, load_index
from tandem.nodes.model.spec import LayerKind, ModelSpec, RopeScaling, load_spec

__all__ = [
    "LayerKind",
    "ModelError",
    "ModelIndex",
    "ModelSpec",
    "RopeScaling",
    "TensorEntry",
    "fingerprint",
    "load_index",
    "load_spec",
]
