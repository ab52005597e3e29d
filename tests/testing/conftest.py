def pytest_configure(config):
    # legacy Colossal-AI marks its multi-process tests so; the ported tests keep the mark
    config.addinivalue_line("markers", "dist: a test that starts several processes (legacy Colossal-AI's mark)")
