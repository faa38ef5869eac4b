"""The JIT machinery: declare -> key -> lock -> compile -> publish -> load, and install-time builds."""
