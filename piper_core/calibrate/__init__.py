"""``piper calibrate``: fit the resource model's hardware terms to this machine.

Micro-benchmarks run on every rank at once (:mod:`.bench`, the only module here that imports
torch, and only inside the rank processes), one launch per benchmark under its own deadline and
cached so an interrupted run resumes (:mod:`.steps`); medians are fitted (:mod:`.fit`,
:mod:`.assemble`) into a :class:`~piper_core.specs.cluster.ClusterSpec` and written with the
measurements and the fit quality as a profile (:mod:`.profile`).

API::

    calibrate(CalibrateOptions(out=Path("me.yaml"), topology=Topology(nodes=1, ranks_per_node=2)))
        -> Calibration(cluster, calibration, outcomes, path)
    load_profile(path) -> ClusterSpec          # also: piper_core.presets.load_cluster(path)
    read_profile(path) -> Profile(cluster, calibration)
"""

from piper_core.calibrate.profile import Profile, is_profile, load_profile, read_profile, write_profile

__all__ = ["Profile", "is_profile", "load_profile", "read_profile", "write_profile"]
