package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/redrive"
)

// selectionFlags are the event selection shared by requeue and replay.
type selectionFlags struct {
	eventIDs      []string
	aggregateType string
	since, until  string
}

func (s *selectionFlags) register(cmd *cobra.Command, withIDs bool) {
	f := cmd.Flags()
	if withIDs {
		f.StringSliceVar(&s.eventIDs, "event-id", nil, "event id to select (repeatable or comma-separated)")
	}
	f.StringVar(&s.aggregateType, "aggregate-type", "", "select events of this aggregate type")
	f.StringVar(&s.since, "since", "", "select events created at or after this time (RFC 3339, or a duration ago such as 24h)")
	f.StringVar(&s.until, "until", "", "select events created before this time (RFC 3339, or a duration ago)")
}

func (s *selectionFlags) apply(c *redrive.Command) error {
	c.EventIDs, c.AggregateType = s.eventIDs, s.aggregateType
	var err error
	if c.Since, err = parseTime("--since", s.since); err != nil {
		return err
	}
	c.Until, err = parseTime("--until", s.until)
	return err
}

// parseTime accepts RFC 3339 or a Go duration meaning "that long ago".
func parseTime(flag, v string) (*time.Time, error) {
	if v == "" {
		return nil, nil
	}
	if t, err := time.Parse(time.RFC3339, v); err == nil {
		return &t, nil
	}
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		t := time.Now().Add(-d).UTC()
		return &t, nil
	}
	return nil, fmt.Errorf("%s %q: want RFC 3339 (2026-11-23T10:00:00Z) or a duration ago (24h)", flag, v)
}

func (a *app) migrateCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "migrate",
		Short: "Apply the outbox, inbox and audit migrations (idempotent)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.do(cmd.Context(), redrive.Command{Operation: redrive.OpMigrate})
		},
	}
}

func (a *app) statusCmd() *cobra.Command {
	var consumer string
	c := &cobra.Command{
		Use:   "status",
		Short: "Show the outbox backlog, publish lag, dead and parked events, and each consumer's queue and DLQ depth",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.do(cmd.Context(), redrive.Command{Operation: redrive.OpStatus, Consumer: consumer})
		},
	}
	c.Flags().StringVar(&consumer, "consumer", "", "only this consumer's queues")
	return c
}

func (a *app) deadCmd() *cobra.Command {
	dead := &cobra.Command{Use: "dead", Short: "Inspect, requeue or discard dead outbox events"}
	var limit int
	var aggType string
	list := &cobra.Command{
		Use:   "list",
		Short: "List dead events (oldest first; no payloads)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.do(cmd.Context(), redrive.Command{Operation: redrive.OpDeadList, Limit: limit, AggregateType: aggType})
		},
	}
	list.Flags().IntVar(&limit, "limit", 100, "at most this many rows")
	list.Flags().StringVar(&aggType, "aggregate-type", "", "only this aggregate type")

	var sel selectionFlags
	var dry bool
	var max int
	requeue := &cobra.Command{
		Use:   "requeue",
		Short: "Put dead events back to pending; each aggregate publishes them in order, then what was parked behind them",
		Example: `  fifobox dead requeue --event-id 0193c1f4-...
  fifobox dead requeue --aggregate-type order --since 24h --dry-run`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c := redrive.Command{Operation: redrive.OpRequeueDead, DryRun: dry, Max: max}
			if err := sel.apply(&c); err != nil {
				return err
			}
			return a.do(cmd.Context(), c)
		},
	}
	sel.register(requeue, true)
	requeue.Flags().BoolVar(&dry, "dry-run", false, "count what would be requeued, change nothing")
	requeue.Flags().IntVar(&max, "max", 0, "refuse a selection larger than this (default 100000)")

	var discardIDs []string
	var reason string
	var discardDry bool
	discard := &cobra.Command{
		Use:   "discard",
		Short: "Give up for good on dead events no broker will accept; their aggregates resume with the events after them",
		Long: `Discard marks the given dead events 'discarded': they are never published,
and each aggregate they parked resumes with its next event. Consumers never
see a discarded event (its sequence number is skipped). Use it for an event
SNS rejects permanently (too large, invalid attribute); requeue instead when
the cause was transient. Audited; --dry-run counts without changing anything.`,
		Example: `  fifobox dead discard --event-id 0193c1f4-... --reason "over 256 KiB, re-issued as 0193c2..." --dry-run`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.do(cmd.Context(), redrive.Command{Operation: redrive.OpDiscardDead, EventIDs: discardIDs, Reason: reason, DryRun: discardDry})
		},
	}
	discard.Flags().StringSliceVar(&discardIDs, "event-id", nil, "dead event id to discard (repeatable; required)")
	discard.Flags().StringVar(&reason, "reason", "", "why the events are discarded (required; recorded)")
	discard.Flags().BoolVar(&discardDry, "dry-run", false, "count what would be discarded, change nothing")
	_ = discard.MarkFlagRequired("event-id")
	_ = discard.MarkFlagRequired("reason")
	dead.AddCommand(list, requeue, discard)
	return dead
}

func (a *app) redriveCmd() *cobra.Command {
	var consumer, from string
	var dry bool
	var max int
	c := &cobra.Command{
		Use:   "redrive",
		Short: "Move a consumer's DLQ (or subscription DLQ) messages back to its queue, keeping message groups and their order",
		Long: `redrive moves the messages of a consumer's DLQ back to its queue, each message group in
order. A consumer in strict order (the default) applies a held aggregate's events as they
come back, the dead one first, and then releases the aggregate. Messages dead-lettered
again while the redrive runs stay for the next one.

--from subscription-dlq moves what SNS could not deliver to the consumer's queue (a
disabled KMS key, a changed queue policy): those events never reached the consumer, so
later events of their aggregates may have been applied before them.`,
		Example: `  fifobox redrive --consumer shipping --dry-run
  fifobox redrive --consumer shipping --max 100
  fifobox redrive --consumer shipping --from subscription-dlq`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if consumer == "" {
				return fmt.Errorf("--consumer is required")
			}
			if from != redrive.SourceDLQ && from != redrive.SourceSubscriptionDLQ {
				return fmt.Errorf("--from %q: want %s or %s", from, redrive.SourceDLQ, redrive.SourceSubscriptionDLQ)
			}
			return a.do(cmd.Context(), redrive.Command{Operation: redrive.OpDLQRedrive, Consumer: consumer, Source: from, DryRun: dry, Max: max})
		},
	}
	c.Flags().StringVar(&consumer, "consumer", "", "consumer whose DLQ to redrive (required)")
	c.Flags().StringVar(&from, "from", redrive.SourceDLQ, "dlq (the consumer queue's DLQ) or subscription-dlq (what SNS could not deliver)")
	c.Flags().BoolVar(&dry, "dry-run", false, "report the DLQ depth, move nothing")
	c.Flags().IntVar(&max, "max", 0, "move at most this many messages (default 100000)")
	return c
}

func (a *app) releaseHoldsCmd() *cobra.Command {
	var consumer string
	var groups []string
	var dry bool
	var max int
	c := &cobra.Command{
		Use:   "release-holds",
		Short: "End a strict-order consumer's holds whose dead-lettered messages are gone (purged or expired)",
		Long: `A consumer in strict order holds an aggregate once it dead-letters one of its events:
later events go to the DLQ behind it until redrive brings them back in order. If the
dead-lettered messages are gone (purged, expired after the DLQ's 14 days), the hold would
never end: release-holds ends it, so the aggregate's next events are applied as they come.
Redrive first if the messages are still in the DLQ (fifobox status shows both counts).`,
		Example: `  fifobox release-holds --consumer shipping --dry-run
  fifobox release-holds --consumer shipping --group order-42`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if consumer == "" {
				return fmt.Errorf("--consumer is required")
			}
			return a.do(cmd.Context(), redrive.Command{Operation: redrive.OpReleaseHolds, Consumer: consumer, Groups: groups, DryRun: dry, Max: max})
		},
	}
	c.Flags().StringVar(&consumer, "consumer", "", "the consumer whose holds to release (required)")
	c.Flags().StringSliceVar(&groups, "group", nil, "only this message group / aggregate id (repeatable; default: every held group)")
	c.Flags().BoolVar(&dry, "dry-run", false, "count what would be released, change nothing")
	c.Flags().IntVar(&max, "max", 0, "refuse a selection larger than this (default 100000)")
	return c
}

func (a *app) replayCmd() *cobra.Command {
	var sel selectionFlags
	var consumer string
	var dry bool
	var max int
	c := &cobra.Command{
		Use:   "replay",
		Short: "Send sent events again to ONE consumer, clearing its inbox entries for them so it re-applies them",
		Long: `replay rebuilds a consumer's read model: the chosen sent events (by aggregate type and
time range) are sent again to that consumer's queue only, in per-aggregate order, and
that consumer's inbox rows for exactly those events are deleted in the same audited
operation. Other consumers see nothing.`,
		Example: `  fifobox replay --consumer orders-projection --aggregate-type order --since 2026-11-01T00:00:00Z`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if consumer == "" {
				return fmt.Errorf("--consumer is required")
			}
			c := redrive.Command{Operation: redrive.OpReplay, Consumer: consumer, DryRun: dry, Max: max}
			if err := sel.apply(&c); err != nil {
				return err
			}
			return a.do(cmd.Context(), c)
		},
	}
	sel.register(c, false)
	c.Flags().StringVar(&consumer, "consumer", "", "the one consumer to replay to (required)")
	c.Flags().BoolVar(&dry, "dry-run", false, "count what would be replayed, change nothing")
	c.Flags().IntVar(&max, "max", 0, "refuse a selection larger than this (default 100000)")
	return c
}

func (a *app) pruneCmd() *cobra.Command {
	var older, inboxOlder time.Duration
	var dry bool
	c := &cobra.Command{
		Use:   "prune",
		Short: "Delete sent outbox events older than --older-than and inbox rows older than --inbox-older-than, in bounded batches",
		Long: `Delete sent outbox events older than --older-than and inbox rows older than
--inbox-older-than, in bounded batches. Deployed, a daily schedule runs this in
the redrive Lambda with the defaults. Keep the inbox retention longer than the
DLQs' message retention (14 days at most): a redriven message that was applied
before is recognised only while its inbox row exists.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.do(cmd.Context(), redrive.Command{Operation: redrive.OpPrune, OlderThan: older.String(),
				InboxOlderThan: inboxOlder.String(), DryRun: dry})
		},
	}
	c.Flags().DurationVar(&older, "older-than", 7*24*time.Hour, fmt.Sprintf("retention for sent events (at least %s)", redrive.MinSentRetention))
	c.Flags().DurationVar(&inboxOlder, "inbox-older-than", inbox.DefaultRetention, fmt.Sprintf("retention for inbox rows (at least %s: longer than the DLQs keep a message)", redrive.MinInboxRetention))
	c.Flags().BoolVar(&dry, "dry-run", false, "count what would be deleted")
	return c
}

func (a *app) auditCmd() *cobra.Command {
	var limit int
	c := &cobra.Command{
		Use:   "audit",
		Short: "Show the most recent operator actions (redrive_audit)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if a.viaLambda != "" {
				return errNoLocal
			}
			pool, err := a.connect(cmd.Context())
			if err != nil {
				return err
			}
			rows, err := redrive.ListAudit(cmd.Context(), pool, limit)
			if err != nil {
				return err
			}
			if a.jsonOut {
				return json.NewEncoder(a.out).Encode(rows)
			}
			w := tabwriter.NewWriter(a.out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "ID\tSTARTED\tOPERATION\tACTOR\tSTATUS\tAFFECTED\tDRY-RUN\tPARAMS")
			for _, r := range rows {
				fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%d\t%t\t%s\n", r.ID, r.StartedAt.UTC().Format(time.RFC3339), r.Operation,
					r.Actor, r.Status, r.Affected, r.DryRun, string(r.Params))
			}
			return w.Flush()
		},
	}
	c.Flags().IntVar(&limit, "limit", 20, "rows to show")
	return c
}

// do runs cmd and prints its result.
func (a *app) do(ctx context.Context, cmd redrive.Command) error {
	res, err := a.run(ctx, cmd)
	if err != nil {
		return err
	}
	return a.print(res)
}

func (a *app) print(res redrive.Result) error {
	if a.jsonOut {
		enc := json.NewEncoder(a.out)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	switch {
	case res.Status != nil:
		printStatus(a, res.Status)
	case res.Operation == redrive.OpDeadList:
		if len(res.Dead) == 0 {
			fmt.Fprintln(a.out, "no dead events")
			return nil
		}
		w := tabwriter.NewWriter(a.out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "EVENT ID\tTYPE\tAGGREGATE\tSEQ\tATTEMPTS\tCREATED\tLAST ERROR")
		for _, d := range res.Dead {
			fmt.Fprintf(w, "%s\t%s\t%s/%s\t%d\t%d\t%s\t%s\n", d.EventID, d.EventType, d.AggregateType, d.AggregateID, d.Sequence,
				d.Attempts, d.CreatedAt.UTC().Format(time.RFC3339), oneLine(d.LastError, 80))
		}
		return w.Flush()
	default:
		msg := res.Message
		if msg == "" {
			msg = fmt.Sprintf("%s: %d affected", res.Operation, res.Affected)
		}
		if res.AuditID != 0 {
			msg += fmt.Sprintf(" (audit #%d)", res.AuditID)
		}
		fmt.Fprintln(a.out, msg)
	}
	return nil
}

func printStatus(a *app, s *redrive.Status) {
	b := s.Backlog
	fmt.Fprintln(a.out, "outbox")
	w := tabwriter.NewWriter(a.out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "  pending\t%d\n", b.Pending)
	fmt.Fprintf(w, "  due (publishable now or in flight)\t%d events, %d aggregates in flight\n", b.DueEvents, b.InFlight)
	fmt.Fprintf(w, "  publish lag (oldest due event)\t%s\n", b.OldestDueAge.Round(time.Millisecond))
	fmt.Fprintf(w, "  backing off after a failed publish\t%d events, %d aggregates retrying\n", b.BackingOffEvents, b.RetryingAggregates)
	fmt.Fprintf(w, "  parked behind dead events\t%d events, %d aggregates, %d dead\n", b.ParkedEvents, b.ParkedAggregates, b.Dead)
	fmt.Fprintf(w, "  oldest unsent event\t%s\n", b.OldestPendingAge.Round(time.Millisecond))
	_ = w.Flush()
	if len(s.Queues) == 0 {
		return
	}
	fmt.Fprintln(a.out, "\nqueues")
	w = tabwriter.NewWriter(a.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "  CONSUMER\tVISIBLE\tIN FLIGHT\tDLQ\tDLQ IN FLIGHT\tSUB DLQ\tHELD GROUPS\tHELD MSGS\t")
	for _, q := range s.Queues {
		if q.Error != "" {
			// Held groups come from the database: shown even without queue figures.
			fmt.Fprintf(w, "  %s\t-\t-\t-\t-\t-\t%d\t%d\t%s\n", q.Consumer, q.HeldGroups, q.HeldMessages, oneLine(q.Error, 60))
			continue
		}
		fmt.Fprintf(w, "  %s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n", q.Consumer, q.Visible, q.InFlight, q.DLQ, q.DLQInFlight,
			q.SubscriptionDLQ, q.HeldGroups, q.HeldMessages)
	}
	_ = w.Flush()
}

func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > n {
		return s[:n-1] + "…"
	}
	return s
}
