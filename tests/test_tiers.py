"""The test tiers (tests/tiers.py), on small suites run in this process by pytester: a test without a tier
fails in both runs, a unit test that would start a process fails before the process starts, and the tests
known to start processes stay out of ``-m unit``."""
import pytest

pytestmark = pytest.mark.unit

INI = """[pytest]
markers =
    unit: starts no process
    processes: starts processes
    network: reads the network
"""
# Process fixtures of the real suite's names, standing in for them: each leaves a file behind when it runs.
CONFTEST = """import pathlib
import pytest

@pytest.fixture
def ray_session(tmp_path_factory):
    (tmp_path_factory.getbasetemp() / "ray_session_ran").touch()

@pytest.fixture
def warmed_up(ray_session):
    pass

@pytest.fixture
def engine():
    pass
"""

LDCONFIG_EVENT = "sys.audit('subprocess.Popen', 'ldconfig', ['ldconfig', '-p'], None, None)"


@pytest.fixture
def suite(pytester):
    """A pytester directory with the tiers plugin, the marks registered and the stand-in fixtures."""
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    return pytester


def run(suite, *args):
    return suite.inline_run("-p", "tiers", "-p", "no:cacheprovider", *args)


def failure_texts(result) -> dict[str, str]:
    """{test name: its failure's text} over every phase's failed report."""
    return {report.nodeid.split("::")[-1]: str(report.longrepr)
            for report in result.getreports("pytest_runtest_logreport") if report.failed}


def test_a_test_without_a_tier_fails_in_the_whole_suite_and_in_the_unit_tier(suite):
    suite.makepyfile(test_new="""
        import pytest

        def test_forgotten():
            pass

        @pytest.mark.unit
        def test_filed():
            pass
    """)
    for args in ((), ("-m", "unit")):
        result = run(suite, *args)
        result.assertoutcome(passed=1, failed=1)
        assert "has no tier: mark it unit" in failure_texts(result)["test_forgotten"]


def test_a_unit_test_with_a_process_fixture_fails_before_the_fixture_runs(suite, tmp_path):
    suite.makepyfile(test_misfiled="""
        import pytest

        @pytest.mark.unit
        def test_direct(ray_session):
            pass

        @pytest.mark.unit
        def test_through_another_fixture(warmed_up):
            pass

        @pytest.mark.unit
        @pytest.mark.processes
        def test_both_marks():
            pass
    """)
    result = run(suite, "--basetemp", str(tmp_path / "base"))
    result.assertoutcome(failed=3)
    texts = failure_texts(result)
    assert "fixtures ['ray_session']" in texts["test_direct"]
    assert "fixtures ['ray_session', 'warmed_up']" in texts["test_through_another_fixture"]
    assert "marks ['processes']" in texts["test_both_marks"]
    assert all("drop the unit mark" in text for text in texts.values())
    assert not (tmp_path / "base" / "ray_session_ran").exists()


def test_a_process_started_in_a_unit_test_fails_it_before_the_process_starts(suite, tmp_path):
    suite.makepyfile(test_starts=f"""
        import multiprocessing
        import os
        import subprocess
        import sys

        import pytest

        pytestmark = pytest.mark.unit
        WITNESS = {str(tmp_path / "witness")!r}

        def test_subprocess():
            subprocess.run([sys.executable, "-c", f"open({{WITNESS!r}}, 'w')"])

        def test_caught_subprocess():
            try:
                subprocess.run(["touch", WITNESS])
            except Exception:
                pass

        def test_multiprocessing():
            multiprocessing.get_context("spawn").Process(target=os.mknod, args=(WITNESS,)).start()

        def test_os_system():
            os.system(f"touch {{WITNESS}}")

        @pytest.fixture
        def server():
            subprocess.Popen(["touch", WITNESS])

        def test_in_a_fixture(server):
            pass
    """)
    result = run(suite)
    result.assertoutcome(failed=5)
    texts = failure_texts(result)
    assert "subprocess.Popen" in texts["test_subprocess"] and "subprocess.Popen" in texts["test_caught_subprocess"]
    assert "multiprocessing.Process.start" in texts["test_multiprocessing"]
    assert "os.system" in texts["test_os_system"]
    assert "subprocess.Popen" in texts["test_in_a_fixture"]
    assert all("mark it processes" in text for text in texts.values())
    assert not (tmp_path / "witness").exists()


def test_a_process_started_by_an_import_is_not_the_tests(suite):
    # the audit event of a process start, as a library that probes its environment at import raises it
    suite.makepyfile(probing_library=f"import sys\n{LDCONFIG_EVENT}\n")
    suite.makepyfile(test_imports=f"""
        import sys

        import pytest

        @pytest.mark.unit
        def test_import():
            import probing_library  # noqa: F401

        @pytest.mark.unit
        def test_call():
            {LDCONFIG_EVENT}
    """)
    result = run(suite)
    result.assertoutcome(passed=1, failed=1)
    assert "subprocess.Popen" in failure_texts(result)["test_call"]


def test_tests_known_to_start_processes_stay_out_of_the_unit_tier(suite):
    suite.makepyfile(test_known="""
        import pytest

        @pytest.mark.processes
        def test_marked():
            pass

        @pytest.mark.network
        def test_network():
            pass

        def test_engine_fixture(engine):
            pass

        @pytest.mark.unit
        def test_unit():
            pass
    """)
    run(suite).assertoutcome(passed=4)
    unit = run(suite, "-m", "unit")
    unit.assertoutcome(passed=1)
    assert [r.nodeid.split("::")[-1] for r in unit.getreports("pytest_runtest_logreport") if r.when == "call"] == [
        "test_unit"]
