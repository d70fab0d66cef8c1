"""Version information for this megatron-core fork."""

MAJOR = 0
MINOR = 20
PATCH = 0
PRE_RELEASE = "dev1"

VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)

__shortversion__ = ".".join(str(part) for part in VERSION[:3])
__version__ = f"{__shortversion__}.{PRE_RELEASE}"

__package_name__ = "megatron-core"
__description__ = (
    "Megatron-core fork whose MLP and MoE-expert paths compute exactly the configured activation"
)
__license__ = "Apache-2.0"
