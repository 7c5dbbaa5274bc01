"""The keys a server holds now: the key file's, read again on SIGHUP. A file that does not
load keeps the keys already held (and says why in the log): a typo must not lock every
tenant out, nor open the door."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from tenancy.keys import KeyTable, load_key_file

log = logging.getLogger("tenancy.keyring")


class KeyRing:
    def __init__(self, table: KeyTable, path: Path | None = None) -> None:
        self.table = table  # replaced whole on reload: readers never see half a file
        self.path = path  # None: --api-key, nothing to reload

    @classmethod
    def from_file(cls, path: Path) -> KeyRing:
        """ValueError (naming the file and the entry) when it does not load."""
        return cls(load_key_file(path), Path(path))

    def reload(self) -> bool:
        """Reads the key file again; False (the old keys kept) when it does not load."""
        if self.path is None:
            log.info("SIGHUP: the API key comes from --api-key: nothing to reload")
            return False
        try:
            table = load_key_file(self.path)
        except ValueError as error:
            log.error("SIGHUP: %s; keeping the %d keys loaded before", error,
                      len(self.table.tenants_by_hash))
            return False
        self.table = table
        log.info("SIGHUP: %d keys of %d tenants loaded from %s", len(table.tenants_by_hash),
                 len(table.tenants), self.path)
        return True

    def reload_on_sighup(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGHUP, self.reload)
