pytest_plugins = [
    "tests.fix_sites",
    "tests.fix_cli",
    "tests.fix_endpoints",
    "tests.fix_listener",
    "tests.fix_node",
    "tests.fix_tls",
]
