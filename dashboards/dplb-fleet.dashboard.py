"""DPLB fleet: every host side by side, as its front balancer sees it (utilization, reported weight, state,
requests, errors). → dplb-fleet.json"""

from _common import Layout, make_dashboard, targets, ts

from dplb.obs import metrics as M

FLEET = 'job="dplb-router"'  # every router: the fleet view ignores the Stack variable; one series per stack label
REJ = M.REQUESTS_REJECTED + "_total"

L = Layout()
L.row("Hosts (from each host's load report)").add(
    ts("Utilization by host", "percentunit",
       targets((f"max by (stack) ({M.HOST_UTILIZATION}{{{FLEET}}})", "{{stack}}")),
       "0-1: 1 when every batch slot or the KV cache is full, or the host drains or has no routable worker "
       "(what Envoy's ORCA weights divide by)."),
    ts("Agent weight reported by host (percent)", "percent",
       targets((f"max by (stack) ({M.HOST_AGENT_WEIGHT}{{{FLEET}}})", "{{stack}}")),
       "The weight the HAProxy agent-check answers while the host is up: 100 / (1 + load)."),
    ts("Host state (1 = down, 2 = drain)", "none",
       targets((f"max by (stack) ({M.HOST_STATE}{{{FLEET}, state=\"down\"}}) + 2 * max by (stack) "
                f"({M.HOST_STATE}{{{FLEET}, state=\"drain\"}})", "{{stack}}")),
       "0 up, 1 down (DPLBHostReportingDown), 2 drain (DPLBHostStuckDraining when it lasts).",
       drawStyle="line", lineInterpolation="stepAfter"),
    ts("Completed requests/s by host", "reqps",
       targets((f"max by (stack) ({M.HOST_RPS}{{{FLEET}}})", "{{stack}}")),
       "Requests the host's workers completed per second (the ORCA rps_fractional)."),
    ts("Load by host (running + waiting over batch slots)", "percentunit",
       targets((f"max by (stack) ({M.HOST_LOAD}{{{FLEET}}})", "{{stack}}")),
       "1 = every batch slot of every routable worker is taken; above 1 requests queue."),
    ts("Rejected requests/s by host", "reqps",
       targets((f"sum by (stack) (rate({REJ}{{{FLEET}}}[$__rate_interval]))", "{{stack}}")),
       "Requests the router answered itself with an error, per host."),
)

dashboard = make_dashboard(
    "DPLB fleet", "dplb-fleet",
    "Every DPLB host side by side as the front balancer (HAProxy, Envoy, the Inference Extension) sees it. "
    "Generated from dashboards/dplb-fleet.dashboard.py; do not edit the JSON.", L)
