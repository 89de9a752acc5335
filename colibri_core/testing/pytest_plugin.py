"""pytest plugin (entry point ``pytest11: colibri``): lists colibri's plugins in the report header
so a conformance run says what it tested, and registers the kit's `system` marker. Imports nothing heavy."""


def pytest_report_header(config):
    try:
        from colibri_core import plugins

        reg = plugins.registry()
        names = ", ".join(f"{p.distribution} {p.version} ({', '.join(p.architectures)})" for p in reg.plugins.values())
        return f"colibri plugins: {names or 'none'}"
    except Exception as e:  # the header must never break a test run; say why loudly instead
        return f"colibri plugins: cannot be listed: {type(e).__name__}: {e}"


def pytest_configure(config):
    """The kit marks its slow checks (kill -9, the int8 container) `system`: a plugin's suite leaves
    them out with `-m "not system"`, and runs under --strict-markers."""
    config.addinivalue_line("markers", "system: the system tier (slow: kill -9 campaigns, every quantisation, "
                                       "clusters, tools); -m 'not system' leaves it out")
