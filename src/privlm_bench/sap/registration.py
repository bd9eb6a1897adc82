"""The sap and sap-service sweeps in the bench's registry: each renders its own reports."""

from privlm_bench.harness.registry import SweepEntry, register
from privlm_bench.sap.service import NAME as SERVICE
from privlm_bench.sap.service import render_service_report
from privlm_bench.sap.sweep import render_sap_report

register(SweepEntry("sap", (), render=render_sap_report))
register(SweepEntry(SERVICE, (), render=render_service_report))
