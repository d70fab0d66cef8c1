"""Model-level enums shared across megatron.core (upstream's ``megatron.core.enums``)."""

import enum


class ModelType(enum.Enum):
    """The kind of model; every model this fork builds parts of is ``encoder_or_decoder``."""

    encoder_or_decoder = 1


class Fp8Recipe(str, enum.Enum):
    """FP8 scaling recipes. A ``str`` enum, so each member equals its name as a plain string."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
    custom = "custom"


class Fp4Recipe(str, enum.Enum):
    """FP4 scaling recipes; members equal their names as plain strings."""

    nvfp4 = "nvfp4"
    custom = "custom"
