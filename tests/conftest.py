import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=10000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items):
    """The container group (the image build and the emulated clusters: several minutes on one worker) first:
    make test's two workers then share the rest while it runs, and neither waits alone at the end for a group
    that started late."""
    def container(item) -> bool:
        group = item.get_closest_marker("xdist_group")
        return group is not None and group.args[:1] == ("container",)

    items.sort(key=lambda item: not container(item))  # stable: each part keeps its order

