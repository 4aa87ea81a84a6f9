"""KVConnectorFactory: a connector class by its `kv_connector` name (vLLM's factory, same registry shape).

Names are registered lazily (module path, class name) so that building a scheduler-side connector
never imports what the others need."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tokenloom.config import ConfigError, KVTransferConfig
from tokenloom.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole

if TYPE_CHECKING:
    from tokenloom.kv_transfer.spec import KVBlockSpec


class KVConnectorFactory:
    _registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def get_connector_class(cls, config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        name = config.kv_connector
        if name not in cls._registry:
            raise ConfigError(f"kv_transfer_config.kv_connector {name!r} is not a tokenloom connector; one of: "
                              f"{', '.join(cls.names())}")
        module_path, class_name = cls._registry[name]
        return getattr(importlib.import_module(module_path), class_name)

    @classmethod
    def create_connector(cls, config: KVTransferConfig, role: KVConnectorRole, spec: KVBlockSpec,
                         **kwargs: Any) -> KVConnectorBase_V1:
        """`spec`: the engine's KV block geometry and fingerprint, which both sides need."""
        return cls.get_connector_class(config)(config, role, spec, **kwargs)


KVConnectorFactory.register_connector(
    "OffloadingConnector", "tokenloom.kv_transfer.offloading.connector", "OffloadingConnector")
KVConnectorFactory.register_connector(
    "SharedStorageConnector", "tokenloom.kv_transfer.shared_storage", "SharedStorageConnector")
KVConnectorFactory.register_connector(
    "SocketConnector", "tokenloom.kv_transfer.socket_connector", "SocketConnector")
