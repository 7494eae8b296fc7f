#!/usr/bin/env python3
"""Generate the sample Markdown corpus used by tests and demos.

The corpus lives in ``sample-corpus/`` at the project root. It is a small set
of fictional documents written by the "Nimbus platform team" that together
exercise every corpus convention the server understands:

* frontmatter ``title`` versus first-H1 versus file-name titles,
* ``rag: false`` (file excluded from the index),
* ``rag_chunk: headings`` (split at headings; the default is one chunk per file),
* ``lifecycle: superseded`` (indexed, but hidden from default search) and its
  ``superseded_by`` successor,
* fenced code blocks (``` and ~~~) containing ``#`` shell comments,
* a setext heading, Markdown tables, nested headings,
* one section longer than the 2048-token embedding budget,
* a Japanese document with ASCII identifiers inside Japanese prose.

The output is deterministic byte for byte: UTF-8 without BOM, LF line endings,
no dates, no randomness. The content is kept here as Python data so that the
committed corpus can be checked against the generator::

    python tools/gen_sample_corpus.py            # (re)write sample-corpus/
    python tools/gen_sample_corpus.py --check    # exit 1 and print a diff if stale
    python tools/gen_sample_corpus.py --dest DIR # write or check another folder

Standard library only.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

PROJECT_ROOT: Path = Path(__file__).resolve().parent.parent
DEFAULT_DEST: Path = PROJECT_ROOT / "sample-corpus"

# Markers that mean "this is a project or repository, not a corpus folder".
# write_corpus() refuses to delete files in such a folder.
_UNSAFE_MARKERS: tuple[str, ...] = (".git", "pyproject.toml", "setup.py")


# ---------------------------------------------------------------------------
# oncall/escalation.md -- plain document, frontmatter with a title only.
# Small enough to stay a single chunk.
# ---------------------------------------------------------------------------

ESCALATION_MD = """\
---
title: On-call escalation policy
---

# On-call escalation policy

This page describes who is paged when something breaks on the Nimbus platform, how quickly they must respond, and what happens when nobody acknowledges a page. It applies to every service owned by the Nimbus platform team, including the Records API, the deploy pipeline and the log shipping fleet.

## Who gets paged for a sev-1

A sev-1 pages the **Platform Primary rotation** immediately, through the pager alias `@platform-oncall`. Alert rules that should page for a sev-1 carry the routing label `pager: platform-sev1`, and the paging service of the same name, `platform-sev1`, always points at whoever is on the Platform Primary rotation that week.

At the same moment, the **Incident Commander rotation** (`@incident-command`) is paged. The primary on-call engineer fixes the problem; the incident commander runs the incident: opens the incident channel, keeps the timeline, talks to support and decides when to pull in more people. On a sev-1 the primary never has to do both.

If the primary does not acknowledge within 5 minutes, the page escalates to the **Platform Secondary rotation** (`@platform-oncall-secondary`). See the escalation timings below.

## Severity levels

| Severity | Definition | Who is paged | Acknowledge within |
| --- | --- | --- | --- |
| sev-1 | Customer-facing outage in any region, data loss or risk of data loss, or a security incident in progress | Platform Primary rotation via `@platform-oncall`, plus the Incident Commander rotation | 5 minutes, day or night |
| sev-2 | Significant degradation: elevated error rate or latency, one feature unavailable, a region running without redundancy | Platform Primary rotation via `@platform-oncall` (low-urgency page at night) | 15 minutes during business hours, 30 minutes at night |
| sev-3 | Minor problem with a workaround, or an internal tool that is down | No page; a ticket in the platform queue | Next business day |
| sev-4 | Cosmetic problem or a question | No page; a ticket in the platform queue | Best effort |

When in doubt, declare the higher severity. Downgrading a sev-1 to a sev-2 after ten minutes costs nothing; discovering an hour later that a "sev-2" was an outage costs a lot.

## Escalation timings

The pager escalates automatically until someone acknowledges. The timings below are measured from the moment the first page is sent.

1. **0 minutes**: the Platform Primary rotation is paged through `@platform-oncall`. For a sev-1, the Incident Commander rotation is paged at the same time.
2. **5 minutes** without acknowledgement: the Platform Secondary rotation is paged. The primary keeps being paged every 2 minutes.
3. **15 minutes** without acknowledgement: the platform engineering manager on duty is paged by phone call, not only by push notification.
4. **30 minutes** without acknowledgement: the Head of Infrastructure is paged, and the incident commander starts calling the Platform Primary and Secondary engineers directly.

Acknowledging a page only means "I am looking at it". If you acknowledge and then realise you cannot work on the problem, for example because you are travelling, reassign the page to the secondary instead of letting it sit.

## Declaring a sev-1

Anyone can declare a sev-1; you do not need to be on call. Run `/incident declare sev-1` in any Slack channel and give a one-line description of what you see. The command pages `@platform-oncall` and `@incident-command`, creates the incident channel and posts the link in `#incidents`. If Slack itself is down, page the Platform Primary rotation directly from the pager app by choosing the `platform-sev1` service.

Do not page individual engineers by name for a sev-1. The rotation is the contract: the person on it has agreed to be reachable, has their laptop with them and knows they are first in line.

## Rotation schedule and hand-over

Both the Platform Primary and the Platform Secondary rotations change every Monday at 10:00 UTC. The outgoing primary writes a short hand-over note in `#platform-oncall` listing open incidents, silenced alerts and anything that is likely to page during the coming week. The incoming primary confirms the hand-over in the same thread; until they do, the outgoing engineer stays on call.

Swaps are allowed and encouraged when someone is ill or on holiday. Make the swap in the pager schedule, not only in chat, so that `@platform-oncall` follows it. A swap that only exists in a chat message does not reroute a single page.

## After the incident

Every sev-1 and every sev-2 that lasted longer than one hour gets a written review within five business days. The incident commander owns the review; the primary on-call engineer contributes the technical timeline. Reviews are blameless: they describe what the system and the people knew at each point, not who should have known better.
"""


# ---------------------------------------------------------------------------
# runbooks/deploy.md -- long runbook, split at headings. Its "## Rollout"
# section is built below and is longer than the embedding budget on purpose.
# ---------------------------------------------------------------------------

DEPLOY_HEAD_MD = """\
---
title: Deploy runbook
rag_chunk: headings
---

# Deploy runbook

This runbook describes how the Nimbus platform team ships a service to production with `deployctl`. It covers what must be true before you start, the rollout itself, how to roll back, and what to do when the tooling misbehaves. It replaces the 2023 procedure, which is kept only for reading old incident reports.

The examples use the Records API (`records-api`), but the procedure is the same for every service that has a `deploy.yaml` in its repository. Questions about this runbook go to `#platform-deploys`.

## Preconditions

Do not start a rollout unless every blocking check below passes. The checks take about five minutes; skipping them is how most failed rollouts begin.

| Check | How to verify | Blocking? |
| --- | --- | --- |
| CI is green on the release commit | Release pipeline page for the commit | Yes |
| Change ticket is approved | Ticket status is `approved` and names the version | Yes |
| No open sev-1 or sev-2 incident | Topic of `#incidents` | Yes |
| Not inside a change freeze | Freeze calendar (see below) | Yes |
| More than 10% of the monthly error budget left | Error-budget panel on the service dashboard | Yes, unless the release fixes the budget burn |
| Release notes list every migration | Release notes in the change ticket | No, but read them before you start the rollout |

Run the local checks from a clean checkout of the release branch:

```bash
# Deploy only from a clean checkout of the release branch
git switch release/2024.11
git status --short
# Show the service name and target version that deployctl will use
cat deploy.yaml
# Make sure nobody else is rolling out this service right now
deployctl status records-api
```

`git status --short` must print nothing. `deployctl status` must report the state `idle`; any other state means a rollout or a rollback of this service is still in progress.

### Change freezes

There are no production rollouts on Fridays after 12:00 UTC, on weekends, or during a declared change freeze. Freezes are announced at least two weeks ahead in `#platform-deploys` and cover the last three business days of each quarter and the week of the largest customer billing run. An exception needs written approval from the platform engineering manager in the change ticket; a message in chat is not enough.
"""

ROLLOUT_INTRO_MD = """\
## Rollout

A rollout moves one service from the version currently serving production to a new, already built artifact. It always starts with a canary in the first wave region and then proceeds wave by wave: `eu-central`, then `us-east`, then `ap-south`. For a typical service the whole procedure takes between 90 and 150 minutes, most of it spent waiting for bake times to pass. Plan for the full window before you start: a rollout left half-finished over a shift change is the most common source of confusion during incidents.

The person who runs the rollout command is the deploy owner until the rollout is finished or explicitly handed over. The deploy owner watches the gates, makes the promote-or-roll-back decision at every wave, and answers questions in the deploy thread. The primary on-call engineer is informed, but is not expected to watch the rollout.

The current rollout command is:

```bash
# Start a canary on 10% of the pods in the first wave region,
# then block until the automated gates pass or fail.
deployctl rollout --canary 10 --wait
# Exit codes: 0 = gates passed, 3 = a gate failed, 4 = timed out waiting
```

Work through the numbered steps in order. Each step says what to do, what to look at, and what to do when something looks wrong. If a step tells you to roll back, stop there and go to the Rollback section; do not try to fix forward in the middle of a rollout.
"""

# (title, body) -- steps before the regional waves.
ROLLOUT_STEPS_BEFORE: list[tuple[str, str]] = [
    (
        "Announce the rollout",
        "Post in `#platform-deploys` before you run anything: the service name, the version you are rolling out, "
        "the change ticket, and the time you expect to finish. Start a thread on that message; every later update "
        "for this rollout goes into the thread, so that someone who joins halfway through can read the whole history "
        "in one place. Only one rollout per service may be in progress at a time. If somebody else has an open thread "
        "for the same service, wait for them to close it, even if their rollout looks finished on the dashboards.",
    ),
    (
        "Tell the on-call engineer",
        "Mention the primary on-call engineer in the deploy thread and say which service you are rolling out. They "
        "do not have to watch, but if an alert fires for a neighbouring service during the next two hours they need "
        "to know that a rollout is in progress, and where to find the person running it. If the on-call engineer is "
        "already busy with an incident, postpone the rollout: a second source of change is the last thing they need "
        "while they are still trying to understand the first one.",
    ),
    (
        "Leave the alerts on",
        "Do not silence or downgrade any alert for the service during the rollout. It is tempting to mute a noisy "
        "alert so that it does not page someone while you are busy, but the alerts are tuned for the service at full "
        "traffic and are the last line of defence if the gates miss something. If an alert is too noisy to live with, "
        "fix its threshold in a separate change after the rollout, and mention the noise in the change ticket so that "
        "the next deploy owner is warned.",
    ),
    (
        "Open the dashboards",
        "Open the service's golden-signals dashboard and the Deploy gates dashboard side by side. Note the error rate, "
        "the p99 latency and the CPU saturation for the last 30 minutes and paste the numbers into the thread. The "
        "automated gates compute their own baseline, but writing it down forces you to look at the service before you "
        "change it, and it gives reviewers a reference if the rollout later turns into an incident. If the service is "
        "already unhealthy before you start, do not start: a rollout on top of an existing problem makes both harder "
        "to diagnose.",
    ),
    (
        "Confirm the artifact",
        "Run `deployctl artifact show` for the version in `deploy.yaml` and compare the image digest with the digest "
        "recorded in the change ticket. The two must match exactly. Also check that the artifact shows a CI signature "
        "and a provenance attestation. `deployctl` refuses unsigned artifacts in production, but it is better to "
        "notice a problem here than to have the rollout rejected after you have announced it. If the digest differs, "
        "someone rebuilt the artifact after the ticket was approved; stop and ask the release author which build is "
        "the intended one.",
    ),
    (
        "Compare the configuration",
        "Run `deployctl config diff <service>` to see every configuration value and secret reference that differs "
        "between the running version and the new one. New keys must already exist in all three regions before the "
        "canary starts, because the canary pods will refuse to start without them, and a key that exists only in "
        "`eu-central` will pass the canary and then break wave 2. Removed keys are harmless to the new version, but "
        "do not delete them from the configuration store until the rollout is complete, or a rollback would start "
        "pods that cannot find them.",
    ),
    (
        "Check the migration plan",
        "Read the release notes for database migrations. Expand migrations, which only add tables, columns or "
        "indexes, run automatically before the first canary pod starts and are safe to ship together with the code "
        "that uses them. Contract migrations, which drop or rename anything, must never ship in the same release as "
        "the code change that stops using the old shape. They go out in a later release, at least 24 hours after "
        "every region runs the new code. If you find a contract migration in a release that also changes application "
        "code, stop and send the release back to its author.",
    ),
    (
        "Write down your abort criteria",
        "Before you start the canary, write in the thread what would make you roll back beyond the automated gates. "
        "Typical criteria are a new error type in the logs, a rise in a business metric such as failed payments, or "
        "a specific endpoint that the release changes getting slower. Deciding this in advance, while nothing is "
        "happening, is much easier than deciding it at minute twelve of a bake with ambiguous graphs in front of you, "
        "and it lets others in the thread hold you to it.",
    ),
    (
        "Start the canary",
        "From the release branch checkout, run `deployctl rollout --canary 10 --wait`. `deployctl` reads the service "
        "name and the target version from `deploy.yaml`, so the command takes no service argument. The `--canary 10` "
        "flag replaces 10% of the pods in the first wave region with the new version; the load balancer weights "
        "traffic by pod count, so roughly a tenth of that region's requests reach the canary. The `--wait` flag keeps "
        "the command in the foreground until the automated gates have reached a verdict. Pressing Ctrl-C only "
        "detaches your terminal; the rollout itself keeps running, and you can follow it again with "
        "`deployctl status`.",
    ),
    (
        "Watch the automated gates",
        "The gates are evaluated every 60 seconds during a 15-minute bake. A canary passes when its error rate stays "
        "within 0.5 percentage points of the baseline, its p99 latency stays below 1.2 times the baseline, its CPU "
        "saturation stays below 80%, and no canary pod restarts. Three consecutive failed evaluations of any gate halt "
        "the rollout automatically, and the command exits with code 3. A halted rollout keeps the canary pods running "
        "so that you can inspect them, but the load balancer stops sending new traffic to them.",
    ),
    (
        "Read the canary logs",
        "While the gates run, read the logs of at least one canary pod directly instead of relying only on the "
        "dashboards: `deployctl logs <service> --cohort canary` follows all canary pods at once. Look for log lines "
        "that are new in this version, for warnings that appear at a much higher rate than on the old pods, and for "
        "stack traces of any kind. The gates only measure aggregate numbers. A new warning that fires once per request "
        "will not move the error rate, but it is often the first sign of a configuration mistake that will hurt at "
        "full traffic.",
    ),
    (
        "Compare the canary and baseline cohorts",
        "Run `deployctl status <service> --cohorts`. It prints the canary pods and the baseline pods side by side, "
        "with request counts, error counts and latency percentiles for each cohort. The numbers should be close. A "
        "canary that served noticeably fewer requests than its share usually failed its readiness probe for part of "
        "the bake, which hides errors instead of producing them; treat it as a failed canary even if the gates "
        "passed, and roll back.",
    ),
    (
        "Check the error-budget burn",
        "Open the error-budget panel and look at the burn rate since the canary started. The gates compare the canary "
        "with the baseline, so they cannot notice a release that makes both cohorts worse at the same time, for "
        "example through a shared cache or a downstream dependency that the new version calls more often. A burn "
        "rate that has risen since the start of the canary, while the gates are green, deserves a closer look before "
        "you promote; a burn rate more than twice the usual level is a reason to roll back.",
    ),
    (
        "Keep the thread current",
        "Post a short update in the deploy thread at least every 15 minutes, even when nothing has happened. Silence "
        "in a deploy thread is ambiguous: it can mean that everything is fine or that the deploy owner is busy with a "
        "problem. Two sentences are enough, for example \"canary at minute 10, gates green, logs clean\". The "
        "updates also make the thread usable as a timeline if the rollout ever ends up in an incident review.",
    ),
    (
        "Decide: promote or roll back",
        "If the rollout command exited with 0 and your own checks agree, continue with wave 1 below. If it exited "
        "with 3, a gate failed: go to the Rollback section now. If it exited with 4, the gates could not reach a "
        "verdict within the bake time, usually because the canary received too little traffic. Extend the bake once "
        "with `deployctl bake <service> --extend 15m`; if it times out a second time, roll back. If you are simply "
        "unsure, run `deployctl pause <service>`. Pausing freezes the rollout where it is, keeps the canary serving, "
        "and gives you time to ask for a second opinion in the thread.",
    ),
]

# One entry per wave: region, share of global traffic, bake minutes, and the
# three region-specific paragraphs (promote, bake, record).
ROLLOUT_WAVES: list[dict[str, str]] = [
    {
        "region": "eu-central",
        "share": "about 25%",
        "bake": "20",
        "promote": (
            "The canary already runs in `eu-central`, so promoting replaces the remaining 90% of the pods in that "
            "region. Traffic there peaks between 08:00 and 10:00 UTC, when European customers start their batch "
            "imports; do not promote into that window, because bursty load makes the latency gate noisy and you will "
            "spend the bake arguing with false alarms."
        ),
        "watch": (
            "Batch imports in `eu-central` produce large request bodies, so this is the wave where memory problems "
            "show up first. Keep the memory panel of the golden-signals dashboard open next to the gates. Memory that "
            "grows steadily without levelling off after ten minutes is a leak, even if no pod has been restarted yet; "
            "roll back rather than waiting for the first out-of-memory kill."
        ),
        "record": (
            "Paste the output of `deployctl status <service>` into the thread and add one sentence in your own words, "
            "for example: \"wave 1 clean, error rate unchanged, p99 up 4 ms\". If anything surprised you during the "
            "canary or this wave, write it down now, while you still remember the details; it is the most useful "
            "input for the release author and for the next person who deploys this service."
        ),
    },
    {
        "region": "us-east",
        "share": "about 45%",
        "bake": "30",
        "promote": (
            "`us-east` is the largest region and the first one that carries the full mix of customer traffic, "
            "including the public API clients that send the oldest request formats. The gates start again with "
            "`us-east`'s own baseline, so a pass in `eu-central` tells you little about compatibility here. Check "
            "that the thread has no open questions from wave 1 before you promote."
        ),
        "watch": (
            "Watch the error rate per endpoint rather than only the total. Old clients concentrate on a few endpoints, "
            "so a compatibility break can double the errors of one endpoint while the total barely moves. The Deploy "
            "gates dashboard has a per-endpoint breakdown under the canary graphs; sort it by change since the start "
            "of the wave. Any endpoint whose error rate has more than doubled is a reason to pause and investigate."
        ),
        "record": (
            "Record the wave in the thread as before. In addition, write down the time at which `us-east` reached "
            "100%. If a customer reports a problem later in the day, support will ask when their region changed "
            "version, and this line in the thread is the fastest way to answer without reconstructing it from the "
            "deploy logs."
        ),
    },
    {
        "region": "ap-south",
        "share": "about 30%",
        "bake": "30",
        "promote": (
            "`ap-south` is the last wave. It runs on older hardware than the other regions, so CPU saturation there "
            "is usually 10 to 15 points higher for the same release. Its traffic peaks between 02:00 and 05:00 UTC. "
            "If the promotion would put the bake inside that window and the release is not urgent, pause and finish "
            "the rollout the next morning; a paused rollout is safe to leave overnight."
        ),
        "watch": (
            "The saturation gate is the one most likely to fail in `ap-south`. A failure that stays just above the 80% "
            "threshold, with error rate and latency unchanged, usually means the region needs more capacity rather "
            "than that the release is broken. Do not override the gate yourself: roll back, and ask in "
            "`#platform-deploys` whether the capacity request should go in before the next attempt."
        ),
        "record": (
            "Record the final wave in the thread. The rollout is not finished yet: the steps below verify the result "
            "across all regions and hand the service back to normal operation. Do not close the thread or remove "
            "your status until you have completed them."
        ),
    },
]

ROLLOUT_STEPS_AFTER: list[tuple[str, str]] = [
    (
        "Verify the finished rollout",
        "Run `deployctl status <service>`. Every region should report the new version and the rollout state should "
        "be `complete`. The previous ReplicaSets are scaled to zero but kept for 24 hours; they are what "
        "`deployctl rollback --to previous` switches back to, so never delete them by hand. If any region still "
        "reports the old version, the rollout is not complete, whatever the dashboards suggest; check the output of "
        "`deployctl status` for a paused or halted wave before doing anything else.",
    ),
    (
        "Check queues and downstream consumers",
        "Open the queue dashboard and check the consumer lag of every queue the service writes to. A release that "
        "changes the shape of a message can pass every gate of its own service while its consumers quietly reject "
        "or dead-letter the new messages. Lag that grows steadily after the last wave, or a dead-letter count that "
        "is no longer zero, means a consumer does not understand what the new version writes. Roll back the "
        "producer first; it is easier to replay a few minutes of messages than to repair hours of them.",
    ),
    (
        "Check the client error reports",
        "Look at the client-side error reports for the service, not only the server-side dashboards. Mobile and "
        "browser clients report failures that never reach the service, for example requests rejected by a changed "
        "validation rule that the client then stops retrying, or a response field that the client can no longer "
        "parse. The reports arrive with a delay of a few minutes, so check them at least ten minutes after the last "
        "wave. A new error type that appears only after the rollout is a reason to roll back, even if its volume "
        "is small.",
    ),
    (
        "Run the production smoke tests",
        "Run `deployctl smoke <service> --env production`. The smoke suite sends synthetic requests to the public "
        "endpoint of every region and checks the responses, including the slow paths that real traffic rarely "
        "exercises. It takes about five minutes. A failed smoke test counts as a failed wave even though all the "
        "gates passed: roll back first and investigate afterwards.",
    ),
    (
        "Update the change ticket",
        "Add the final version, the start and end times, a link to the deploy thread and any deviation from this "
        "runbook to the change ticket, then move it to `deployed`. Deviations include an extended bake, a pause, or a "
        "wave promoted outside the recommended window. They are not failures, but reviewers need to see them to know "
        "which parts of this runbook do not match reality.",
    ),
    (
        "Stay for the post-deploy watch",
        "For 60 minutes after the last promotion you remain the deploy owner. Alerts for the service during that hour "
        "are routed to you as well as to the on-call engineer, and you are the person who decides whether an alert is "
        "related to the release. Most regressions that slip past the gates appear within this hour, typically when a "
        "scheduled job runs against the new code for the first time.",
    ),
    (
        "Hand over if your shift ends",
        "If you cannot stay for the whole rollout and the post-deploy watch, hand over explicitly. Write in the thread "
        "who takes over, which step they start at, and anything you noticed that is not visible on the dashboards. "
        "The new deploy owner confirms in the thread. Until they do, the rollout is still yours, even if you have "
        "logged off.",
    ),
    (
        "Close the thread",
        "When the post-deploy watch ends without incident, post a final message in the thread, for example "
        "\"rollout complete, watch ended, no issues\", and clear your status. If anything in this runbook was "
        "wrong, missing or confusing, open a change to this page the same day. The runbook is only as good as the "
        "last rollout that was honest about it.",
    ),
]


def _rollout_steps() -> list[tuple[str, str]]:
    """All numbered rollout steps in order, with the wave steps built per region."""
    steps: list[tuple[str, str]] = list(ROLLOUT_STEPS_BEFORE)
    for number, wave in enumerate(ROLLOUT_WAVES, start=1):
        region = wave["region"]
        steps.append(
            (
                f"Promote to wave {number} ({region})",
                f"Run `deployctl promote <service>`. Wave {number} moves all of `{region}` to the new version; the "
                f"region carries {wave['share']} of global traffic. {wave['promote']}",
            )
        )
        steps.append(
            (
                f"Bake wave {number}",
                f"Wait for the full {wave['bake']}-minute bake in `{region}` before you decide anything, even when "
                f"the graphs look flat after five minutes. {wave['watch']}",
            )
        )
        steps.append((f"Record wave {number} in the thread", wave["record"]))
    steps.extend(ROLLOUT_STEPS_AFTER)
    return steps


def _rollout_section() -> str:
    """The over-long "## Rollout" section: intro, command block, numbered steps."""
    paragraphs = [
        f"{number}. **{title}.** {body}"
        for number, (title, body) in enumerate(_rollout_steps(), start=1)
    ]
    return ROLLOUT_INTRO_MD + "\n" + "\n\n".join(paragraphs) + "\n"


DEPLOY_TAIL_MD = """\
## Rollback

Roll back as soon as a gate fails, when you see errors that the gates did not catch, or when anyone in the deploy thread asks you to and you cannot rule out a problem within five minutes. Rolling back is cheap; debugging a half-rolled-out release in production is not.

The current rollback command is:

```bash
# Switch every region back to the previous ReplicaSets
deployctl rollback --to previous
# Follow the rollback until every region reports the previous version
deployctl status records-api --watch
```

`deployctl rollback --to previous` works at any point during a rollout and for 24 hours after it completes, because the previous ReplicaSets are kept, scaled to zero, for that long. It switches all regions in parallel rather than wave by wave and usually finishes within three minutes. After 24 hours, roll back by rolling out the older artifact with the normal rollout procedure.

Post in the deploy thread when you start the rollback and again when it has finished. A rollback is not an incident by itself, but if customers were affected before you rolled back, declare one according to the on-call escalation policy.

### Database

A rollback does not undo migrations. Expand migrations are harmless to the previous version, which simply ignores the new tables and columns, so in the normal case there is nothing to do. Only when a contract migration went out by mistake does the previous version find its data missing. Check that first:

~~~bash
# List the migrations applied since the previous release
deployctl migrations diff records-api --to previous
# Only if the diff shows a contract step: restore the dropped data
# from the snapshot that deployctl takes before every rollout
deployctl migrations restore records-api --snapshot pre-deploy
~~~

Never run the restore on your own. Page the database on-call engineer, agree on the restore in the incident channel, and let them run it; restoring over live writes loses data if it is done at the wrong moment.

### Feature flags

Many changes ship dark behind a feature flag. Turning the flag off is often faster than a rollback and does not touch the other changes in the same release. Flags are managed with `flagctl`, for example `flagctl set records.bulk_import off --env production`. A flag change reaches every region within 30 seconds.

Use the flag first when the failing behaviour is clearly behind it. When you are not sure which change causes the problem, roll back the whole release: guessing at flags during an incident wastes the minutes that matter most.

Troubleshooting
---------------

| Symptom | Likely cause | What to do |
| --- | --- | --- |
| The rollout command exits with code 3 within two minutes | Canary pods crash on start, usually because of a missing secret or configuration key | Roll back, then read `deployctl logs <service> --cohort canary` |
| The rollout command exits with code 4 | The canary received too little traffic for the gates to decide | Extend the bake once; if it times out again, roll back |
| `artifact not signed` | The artifact was built outside CI | Stop; ask the release author for the CI build |
| `rollout already in progress` | Another rollout or rollback of the same service is running | Find its thread in `#platform-deploys`; never force it |
| The rollback reports `previous ReplicaSet not found` | More than 24 hours have passed since the rollout completed | Roll out the older artifact with the normal procedure |

### When deployctl itself is unavailable

If `deployctl` cannot reach the deploy controller, do not try to change production by other means. A rollout that is already running continues without your terminal, and a halted rollout stays halted. Post in `#platform-deploys`; the deploy pipeline belongs to the Nimbus platform team, so an outage of the controller during business hours is a sev-2 for the platform on-call engineer.
"""


def _deploy_md() -> str:
    return DEPLOY_HEAD_MD + "\n" + _rollout_section() + "\n" + DEPLOY_TAIL_MD


# ---------------------------------------------------------------------------
# runbooks/deploy-2023.md -- superseded older version of the runbook. The old
# commands must appear in this file only.
# ---------------------------------------------------------------------------

DEPLOY_2023_MD = """\
---
title: Deploy runbook (2023, superseded)
lifecycle: superseded
superseded_by: runbooks/deploy.md
rag_chunk: headings
---

# Deploy runbook (2023)

> **Superseded.** This is the deploy procedure the Nimbus platform team used during 2023. It is kept for reading old incident reports and change tickets. Do not follow it for new deploys; the current procedure is the Deploy runbook in `runbooks/deploy.md`.

## Preconditions

- The release commit is merged to `main` and CI is green.
- The deploy is announced in `#deploys` at least 15 minutes in advance.
- Nobody else is deploying the same service; check the channel history.

## Rollout

In 2023 there were no canaries and no automated gates. A deploy pushed the new image to every region in one step:

```bash
# Push the new image to all regions at the same time
kubectl-deploy push --all-at-once
# Then watch the pods until they are all Running
kubectl-deploy status
```

After the push, the deployer watched the error-rate graph for ten minutes. If it stayed flat, the deploy was considered done; there was no smoke test and no post-deploy watch.

## Rollback

To roll back, the deployer reverted to the image that `kubectl-deploy` had recorded before the last push:

```bash
# Revert every region to the previously recorded image
kubectl-deploy revert
```

`kubectl-deploy revert` only remembered one previous image. Two deploys in quick succession made the original version unreachable, and the only way back was to rebuild it from source.

Database changes were never reverted automatically. Whoever ran the deploy restored data by hand, following the instructions in the release ticket, if there were any.

## Known problems

- Pushing to all regions at once meant that a bad release hit every customer at the same time. The March 2023 outage of the Records API was caused by exactly this.
- There was no record of who was deploying, so two people occasionally deployed the same service within minutes of each other.
- The ten-minute watch missed problems that only appeared under the morning batch load in `eu-central`.

These problems are the reason the current runbook uses a canary, regional waves and automated gates.
"""


# ---------------------------------------------------------------------------
# private/offsite-backup.md -- excluded from the index with rag: false. The
# token below must appear in this file only.
# ---------------------------------------------------------------------------

OFFSITE_BACKUP_MD = """\
---
title: Offsite backup restore credentials
rag: false
---

# Offsite backup restore credentials

**Restricted.** This page is excluded from the search index on purpose (`rag: false`). Do not copy its contents into other pages, tickets or chat messages.

The record store is backed up every night to a cold-storage account at a second provider, outside the Nimbus production network. The backups are encrypted with a key held in escrow. To start a restore, the provider's support desk asks for the escrow reference below together with the name of one of the two authorised contacts.

Escrow reference: `SECRET-OFFSITE-TOKEN-7731`

## Restore procedure

1. Two people from the Nimbus platform team must be present for the whole restore; one of them must be an authorised contact.
2. The authorised contact calls the provider's support desk and quotes the escrow reference.
3. The provider releases the encrypted archive to the restore bucket. This takes up to four hours.
4. Restore into the isolated recovery environment first, never directly into production, and verify the record counts against the last backup report.
5. Rotate the escrow reference within 24 hours of any restore and update this page.
"""


# ---------------------------------------------------------------------------
# ja/log-collection.md -- Japanese document, no frontmatter: its title comes
# from the first H1. ASCII identifiers appear inside Japanese prose.
# ---------------------------------------------------------------------------

LOG_COLLECTION_JA_MD = """\
# ログ収集ガイド

このドキュメントでは、Nimbus プラットフォームチームが運用しているログ収集の仕組みと、各サービスからログを送信するための設定方法を説明します。東京オフィスのメンバー向けに書いたものですが、内容は英語版の運用ドキュメントと同じです。

## 概要

各サービスのコンテナは、ログを JSON 形式で標準出力に書き出します。各ノードで動作する `nimbus-log-shipper` がそのログを収集し、中央のログ基盤へまとめて送信します。アプリケーション側でログファイルを書き出したり、ローテーションを設定したりする必要はありません。

ログの 1 行には、少なくとも `timestamp`、`level`、`message` の 3 つのフィールドを含めてください。`service` フィールドはシッパーが自動的に付与するため、アプリケーションで設定する必要はありません。

## 設定

ログの送信先は環境変数 `LOG_SHIPPER_ENDPOINT` で指定します。値を省略するとクラスタの既定の送信先が使われますが、本番環境では必ず明示的に設定してください。

ログの保持期間は環境変数 `LOG_RETENTION_DAYS` で、日数として指定します。既定値は 14 日です。監査の対象となるサービスでは、`LOG_RETENTION_DAYS` を 400 に設定する必要があります。

| 環境変数 | 説明 | 既定値 |
| --- | --- | --- |
| `LOG_SHIPPER_ENDPOINT` | ログの送信先 URL | クラスタの既定値 |
| `LOG_RETENTION_DAYS` | ログを保持する日数 | `14` |
| `LOG_SHIPPER_BATCH_SIZE` | 1 回の送信にまとめるログの行数 | `500` |

本番環境での設定例を示します。

```bash
# 本番環境の送信先を明示的に指定する
export LOG_SHIPPER_ENDPOINT=https://logs.nimbus.internal:6514
# 監査対象のサービスは 400 日間保持する
export LOG_RETENTION_DAYS=400
```

`LOG_SHIPPER_BATCH_SIZE` を大きくすると送信回数は減りますが、シッパーが停止したときに失われるログの量が増えます。特別な理由がない限り、既定値のまま使ってください。

## ログが届かないとき

ログ基盤にログが表示されない場合は、次の順に確認してください。

1. ノード上で `nimbus-log-shipper status` を実行し、シッパーが動作しているか確認します。
2. `LOG_SHIPPER_ENDPOINT` の値にスペルミスがないか、ポート番号が `6514` になっているか確認します。
3. ログが JSON として正しく出力されているか確認します。JSON として解析できない行は、シッパーが破棄します。
4. それでも解決しない場合は、`#platform-logs` チャンネルで質問してください。障害の疑いがある場合は、オンコール担当者に連絡してください。
"""


# ---------------------------------------------------------------------------
# reference/api.md -- reference document with exact identifiers; no
# frontmatter, title from the H1.
# ---------------------------------------------------------------------------

API_REFERENCE_MD = """\
# Records API reference

The Records API is the internal HTTP interface to the Nimbus record store. Every service that reads or writes customer records goes through it; direct database access is not allowed. The API is served in each region at `https://api.<region>.nimbus.internal`.

## Configuration

Clients are configured through environment variables. The official client libraries read them automatically.

| Variable | Required | Meaning |
| --- | --- | --- |
| `NIMBUS_API_TOKEN` | Yes | Bearer token for the calling service. Issued per service and per environment; never share one token between services. |
| `NIMBUS_REGION` | Yes | Region to talk to: `eu-central`, `us-east` or `ap-south`. Clients never fall back to another region on their own. |
| `NIMBUS_API_TIMEOUT_MS` | No | Per-request timeout in milliseconds. Default `5000`. |

The token is sent in the `Authorization: Bearer` header. A request without a valid `NIMBUS_API_TOKEN` fails with `E4010`.

## Endpoints

### POST /api/v1/records

Creates a record. The body is a JSON object with a `type` and a `data` field. The response is `201 Created` with the new record's `id` and its `version`, which starts at `1`.

```http
POST /api/v1/records
Content-Type: application/json

{"type": "invoice", "data": {"customer": "c-1042", "amount_cents": 129900}}
```

### GET /api/v1/records/{id}

Returns the record with the given `id`, including its current `version`. An unknown `id` returns `404` with error code `E4040`.

### PUT /api/v1/records/{id}

Replaces the record's `data`. The request must send the version it read in the `If-Match` header. When another writer has updated the record in the meantime, the API rejects the request with `409` and error code `E4091` (record version conflict).

## Error codes

Every error response has a JSON body with `code`, `message` and `request_id`. Quote the `request_id` when you ask for help in `#platform-api`.

| Code | HTTP status | Meaning | What the client should do |
| --- | --- | --- | --- |
| `E4010` | 401 | Missing or invalid token | Check `NIMBUS_API_TOKEN`; do not retry |
| `E4040` | 404 | Record not found | Do not retry |
| `E4091` | 409 | Record version conflict: the `If-Match` version is not the current version | Read the record again, reapply the change, and send it with the new version |
| `E4290` | 429 | Rate limited | Wait for the number of seconds in `Retry-After`, then retry |
| `E5030` | 503 | Region temporarily unavailable | Retry with backoff |

## Client retry configuration

The client libraries retry `E4290` and `E5030` automatically. They never retry `E4091`, because retrying with the same version fails again; the caller must read the record and reapply its change. Retries are configured in `nimbus-client.toml`:

| Key | Default | Meaning |
| --- | --- | --- |
| `retry.max_attempts` | `3` | Total number of attempts, including the first request |
| `retry.backoff_ms` | `200` | Initial delay between attempts, doubled after each attempt |
| `retry.max_backoff_ms` | `5000` | Upper limit for the delay between attempts |

```toml
# nimbus-client.toml for a batch job that can afford to wait
[retry]
max_attempts = 5
backoff_ms = 200
max_backoff_ms = 5000
```

Keep `retry.max_attempts` low for request paths that serve users directly: a user-facing request that retries five times with backoff is slower than one that fails fast and shows an error.
"""


# ---------------------------------------------------------------------------
# reference/glossary.md -- no frontmatter and no heading at all, so its title
# must come from the file name.
# ---------------------------------------------------------------------------

GLOSSARY_MD = """\
Terms used in the Nimbus platform team's runbooks and reference pages, in alphabetical order.

**Bake time**: the period after a canary or a wave starts during which the automated gates compare the new version with the baseline. Nothing is promoted before the bake time has passed.

**Canary**: a small share of the pods in one region that runs the new version before everyone else does. If the canary misbehaves, only a fraction of one region's traffic is affected.

**Deploy owner**: the person who started a rollout and is responsible for it until it is finished or explicitly handed over.

**Error budget**: the amount of failure a service may have in a month without breaking its availability objective. When less than 10% of the budget is left, only releases that fix reliability problems are deployed.

**Expand and contract**: the way database schema changes are shipped. The expand step only adds; the contract step removes, and ships in a later release once no running code needs the old shape.

**Gate**: an automated check that a canary or a wave must pass before it can be promoted, for example an error-rate or latency limit.

**Rotation**: a schedule of people who take turns being on call. Pages go to a rotation, never to a named person.

**Sev-1**: the highest incident severity: a customer-facing outage, data loss, or a security incident in progress. The on-call escalation policy says who is paged.

**Wave**: one step of a rollout that moves a whole region to the new version. Waves run one after another: `eu-central`, `us-east`, `ap-south`.
"""


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def expected_files() -> dict[str, str]:
    """Return the corpus as ``{relative POSIX path: file text}``, sorted by path.

    Pure: no I/O, same result on every call.
    """
    files: dict[str, str] = {
        "ja/log-collection.md": LOG_COLLECTION_JA_MD,
        "oncall/escalation.md": ESCALATION_MD,
        "private/offsite-backup.md": OFFSITE_BACKUP_MD,
        "reference/api.md": API_REFERENCE_MD,
        "reference/glossary.md": GLOSSARY_MD,
        "runbooks/deploy-2023.md": DEPLOY_2023_MD,
        "runbooks/deploy.md": _deploy_md(),
    }
    return {path: files[path] for path in sorted(files)}


def _encode(text: str) -> bytes:
    """UTF-8 without BOM, LF line endings."""
    return text.replace("\r\n", "\n").replace("\r", "\n").encode("utf-8")


def _existing_files(dest: Path) -> list[str]:
    """Relative POSIX paths of all regular files (and symlinks) under ``dest``, sorted."""
    if not dest.is_dir():
        return []
    found: list[str] = []
    for root, dirs, names in os.walk(dest, followlinks=False):
        dirs.sort()
        for name in names:
            full = Path(root) / name
            found.append(full.relative_to(dest).as_posix())
    return sorted(found)


def _check_dest_is_safe(dest: Path) -> None:
    """Refuse to clean up a folder that looks like a project, not a corpus."""
    resolved = dest.resolve()
    if resolved in (PROJECT_ROOT, Path(resolved.anchor), Path.home().resolve()):
        raise ValueError(f"refusing to write the sample corpus into {resolved}")
    for marker in _UNSAFE_MARKERS:
        if (resolved / marker).exists():
            raise ValueError(
                f"refusing to write the sample corpus into {resolved}: it contains {marker}"
            )


def write_corpus(dest: Path | str = DEFAULT_DEST) -> list[str]:
    """Write the expected files to ``dest`` and remove every other file there.

    Files whose bytes are already correct are left untouched. Directories that
    become empty are removed. Returns the sorted list of relative paths written.
    """
    dest = Path(dest)
    _check_dest_is_safe(dest)
    expected = expected_files()

    for rel in _existing_files(dest):
        if rel not in expected:
            (dest / rel).unlink()

    for rel, text in expected.items():
        target = dest / rel
        data = _encode(text)
        if target.is_symlink() or target.is_dir():
            raise ValueError(f"{target} is not a regular file")
        if target.is_file() and target.read_bytes() == data:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    # Remove directories left empty, deepest first.
    for root, _dirs, _names in os.walk(dest, topdown=False):
        path = Path(root)
        if path != dest and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()

    return list(expected)


def _lines(data: bytes) -> list[str]:
    return data.decode("utf-8", errors="replace").splitlines(keepends=True)


def diff_corpus(dest: Path | str = DEFAULT_DEST) -> list[str]:
    """Unified diff from the corpus on disk (``a/``) to the expected corpus (``b/``).

    Covers changed, missing and unexpected files. Returns an empty list when
    ``dest`` matches byte for byte. Every returned line ends with a newline.
    """
    dest = Path(dest)
    expected = expected_files()
    existing = set(_existing_files(dest))
    out: list[str] = []

    for rel in sorted(existing | set(expected)):
        path = dest / rel
        if rel not in expected:
            actual = path.read_bytes() if path.is_file() else b""
            out.append(f"file not expected: {rel}\n")
            out.extend(difflib.unified_diff(_lines(actual), [], f"a/{rel}", "/dev/null"))
            continue

        want = _encode(expected[rel])
        if rel not in existing or not path.is_file():
            out.append(f"missing file: {rel}\n")
            out.extend(difflib.unified_diff([], _lines(want), "/dev/null", f"b/{rel}"))
            continue

        actual = path.read_bytes()
        if actual == want:
            continue
        diff = list(difflib.unified_diff(_lines(actual), _lines(want), f"a/{rel}", f"b/{rel}"))
        if not diff:
            # Bytes differ but the decoded lines do not (e.g. invalid UTF-8
            # that decodes to the same replacement characters).
            diff = [f"--- a/{rel}\n", f"+++ b/{rel}\n", "bytes differ (encoding)\n"]
        out.extend(diff)

    return [line if line.endswith("\n") else line + "\n" for line in out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write (or check) the deterministic sample Markdown corpus."
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; print a unified diff and exit 1 if the corpus is out of date",
    )
    parser.add_argument(
        "--dest",
        type=Path,
        default=DEFAULT_DEST,
        help=f"corpus folder (default: {DEFAULT_DEST})",
    )
    args = parser.parse_args(argv)
    dest: Path = args.dest

    if args.check:
        diff = diff_corpus(dest)
        if diff:
            sys.stdout.writelines(diff)
            sys.stdout.flush()
            print(
                f"{dest} is out of date; run: python tools/gen_sample_corpus.py"
                + ("" if dest == DEFAULT_DEST else f" --dest {dest}"),
                file=sys.stderr,
            )
            return 1
        print(f"{dest} is up to date", file=sys.stderr)
        return 0

    try:
        written = write_corpus(dest)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
