"""Media: where a block's bytes can be. The interface (`ColdMedium`, block specs, the
registry) is in base.py; each medium below host RAM has its own folder.

base.py           block specs per medium, the ColdMedium interface, the medium registry
block_format.py   a stored block, medium-neutral: header, checksum, codec (encryption hook)
aead_codec.py     AES-256-GCM BlockCodec (--kv-encrypt-key-file): cold KV sealed at rest
host.py           host-RAM slab: slots, two-phase pins (the tier between device and media)
disk/             the "disk" medium: checksummed block files, upkeep, purge
remote/           the "remote" medium: blocks shared by replicas through one Redis
"""

from tierguard.kv.media.base import (
    BlockSpec,
    Buffer,
    ColdMedium,
    DeviceBlocks,
    HostSlots,
    KeyedBlocks,
    MediumContext,
    MediumFactory,
    create_medium,
    register_medium,
)

__all__ = [
    "BlockSpec",
    "Buffer",
    "ColdMedium",
    "DeviceBlocks",
    "HostSlots",
    "KeyedBlocks",
    "MediumContext",
    "MediumFactory",
    "create_medium",
    "register_medium",
]
