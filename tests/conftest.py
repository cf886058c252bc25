pytest_plugins = ["tests.fix_sites", "tests.fix_cli"]
