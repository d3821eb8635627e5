package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport"
)

// printResult prints res as JSON (--json) or text.
func (a *app) printResult(res redrive.Result) {
	if a.jsonOut {
		enc := json.NewEncoder(a.out)
		enc.SetIndent("", "  ")
		_ = enc.Encode(res)
		return
	}
	a.printText(res)
}

func (a *app) printText(res redrive.Result) {
	switch {
	case res.Status != nil:
		printStatus(a.out, res.Status)
	case res.Operation == redrive.OpDeadList:
		printDead(a.out, res.Dead)
	case res.Operation == redrive.OpAudit:
		printAudit(a.out, res.Audit)
	case res.DLQ != nil && res.Operation != redrive.OpDLQDiscard:
		printDLQ(a.out, res)
	default:
		msg := res.Message
		if msg == "" {
			msg = fmt.Sprintf("%s: %d affected", res.Operation, res.Affected)
		}
		if res.AuditID != 0 {
			msg += fmt.Sprintf(" (audit #%d)", res.AuditID)
		}
		fmt.Fprintln(a.out, msg)
		if res.DLQ != nil && len(res.DLQ.Messages) > 0 {
			printMessages(a.out, res.DLQ.Messages)
		}
	}
}

func printStatus(w io.Writer, s *redrive.Status) {
	o := s.Outbox
	fmt.Fprintln(w, "outbox")
	if !o.OK() {
		fmt.Fprintf(w, "  could not be read (%s): %s\n", o.State, o.Error)
	} else {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "  pending\t%d\n", o.Pending)
		fmt.Fprintf(tw, "  due (publishable now or in flight)\t%d events, %d aggregates in flight\n", o.DueEvents, o.InFlightAggregates)
		fmt.Fprintf(tw, "  publish lag (oldest due event)\t%s\n", age(o.OldestDueAge))
		fmt.Fprintf(tw, "  backing off after a failed publish\t%d events, %d aggregates retrying\n", o.BackingOffEvents, o.RetryingAggregates)
		fmt.Fprintf(tw, "  parked behind dead events\t%d events, %d aggregates, %d dead\n", o.ParkedEvents, o.ParkedAggregates, o.Dead)
		fmt.Fprintf(tw, "  oldest unsent event\t%s\n", age(o.OldestPendingAge))
		if o.StrandedEvents > 0 {
			fmt.Fprintf(tw, "  stranded (no claim reaches them)\t%d events pending over %s: run fifobox repair-heads\n",
				o.StrandedEvents, outbox.StrandedAfter)
		}
		txNote := ""
		if o.OldestTransactionPartial {
			txNote = " (the migration owner's sessions only: it lacks pg_read_all_stats)"
		}
		fmt.Fprintf(tw, "  oldest open transaction (server)\t%s%s\n", age(o.OldestTransactionAge), txNote)
		_ = tw.Flush()
	}

	fmt.Fprintln(w, "\nwhy events retry or died")
	e := s.Errors
	switch {
	case !e.OK():
		fmt.Fprintf(w, "  could not be read (%s): %s\n", e.State, e.Error)
	case len(e.Classes) == 0:
		fmt.Fprintln(w, "  no retrying or dead events")
	}
	for _, c := range e.Classes {
		what := "aggregates retrying"
		if c.Kind == "dead" {
			what = "events dead"
		}
		fmt.Fprintf(w, "  %d %s: %s\n", c.Count, what, c.Class)
		if c.Newest != c.Class {
			fmt.Fprintf(w, "    newest: %s\n", strings.Join(strings.Fields(c.Newest), " "))
		}
	}

	q := s.Queues
	title := "\nqueues"
	if q.Transport != "" {
		title += " (" + q.Transport + ")"
	}
	fmt.Fprintln(w, title)
	if !q.OK() && len(consumerErrors(q.Consumers)) == 0 {
		fmt.Fprintf(w, "  could not be read (%s): %s\n", q.State, q.Error)
	}
	if len(q.Consumers) == 0 {
		if q.OK() {
			fmt.Fprintln(w, "  no consumers")
		}
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  CONSUMER\tSTATE\tVISIBLE\tIN FLIGHT\tRETRYING\tDLQ\tDLQ IN FLIGHT\tSUB DLQ\tHELD GROUPS\tHELD MSGS\tPARKED")
	for _, d := range q.Consumers {
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", d.Consumer, d.State, fig(d.Visible), fig(d.InFlight), fig(d.Retrying),
			fig(d.DLQ), fig(d.DLQInFlight), subFig(d), fig(d.HeldGroups), fig(d.HeldMessages), fig(d.ParkedGroups))
	}
	_ = tw.Flush()
	for _, ce := range consumerErrors(q.Consumers) {
		fmt.Fprintf(w, "  %s: %s\n", strings.Join(ce.consumers, ", "), ce.err)
	}
	for _, d := range q.Consumers {
		if d.Error != "" && (d.State == redrive.StateOK || d.State == redrive.StateNone) {
			fmt.Fprintf(w, "  %s: %s\n", d.Consumer, d.Error)
		}
	}
}

// age is a duration as status shows it.
func age(d redrive.Duration) string { return time.Duration(d).Round(time.Millisecond).String() }

// fig is a figure, "-" when it could not be read.
func fig(n int64) string {
	if n < 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

func subFig(d redrive.QueueDepth) string {
	if d.SubscriptionDLQState == redrive.StateNone {
		return "n/a"
	}
	return fig(d.SubscriptionDLQ)
}

func printDead(w io.Writer, dead []redrive.DeadItem) {
	if len(dead) == 0 {
		fmt.Fprintln(w, "no dead events")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "EVENT ID\tTYPE\tAGGREGATE\tSEQ\tATTEMPTS\tCREATED\tLAST ERROR")
	for _, d := range dead {
		fmt.Fprintf(tw, "%s\t%s\t%s/%s\t%d\t%d\t%s\t%s\n", d.EventID, d.EventType, d.AggregateType, d.AggregateID, d.Sequence,
			d.Attempts, d.CreatedAt.UTC().Format(time.RFC3339), oneLine(d.LastError, 100))
	}
	_ = tw.Flush()
	fmt.Fprintln(w, "(last errors in full: --json)")
}

func printAudit(w io.Writer, rows []redrive.AuditEntry) {
	if len(rows) == 0 {
		fmt.Fprintln(w, "no audited operations")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTARTED\tOPERATION\tACTOR\tSTATUS\tAFFECTED\tDRY-RUN\tPARAMS")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d\t%t\t%s\n", r.ID, r.StartedAt.UTC().Format(time.RFC3339), r.Operation,
			r.Actor, r.Status, r.Affected, r.DryRun, string(r.Params))
	}
	_ = tw.Flush()
}

func printDLQ(w io.Writer, res redrive.Result) {
	l := res.DLQ
	total := "an unknown number of"
	if l.Total >= 0 {
		total = fmt.Sprint(l.Total)
	}
	fmt.Fprintf(w, "%s of %s: %s messages; %d shown", l.From, l.Consumer, total, len(l.Messages))
	if !l.Complete {
		fmt.Fprint(w, " (not every message could be looked at: on SNS/SQS each group's first messages only, the rest wait behind them)")
	}
	fmt.Fprintln(w)
	if res.Operation == redrive.OpDLQPeek {
		for _, m := range l.Messages {
			fmt.Fprintf(w, "\nmessage %s (group %s", m.Key, m.Group)
			if m.ID != "" && m.ID != m.Key {
				fmt.Fprintf(w, ", broker id %s", m.ID)
			}
			fmt.Fprintln(w, ")")
			if m.EventType != "" {
				fmt.Fprintf(w, "  event: %s %s/%s seq %d\n", m.EventType, m.AggregateType, m.Group, m.Sequence)
			}
			if m.ErrorClass != "" || m.ErrorReason != "" {
				fmt.Fprintf(w, "  died: %s: %s\n", m.ErrorClass, m.ErrorReason)
			}
			if m.DeadAt != nil {
				fmt.Fprintf(w, "  dead at: %s\n", m.DeadAt.UTC().Format(time.RFC3339))
			}
			fmt.Fprintf(w, "  body: %s\n", m.Body)
		}
	} else if len(l.Messages) > 0 {
		printMessages(w, l.Messages)
	}
	if len(l.Held) > 0 {
		fmt.Fprintln(w, "\nheld groups (strict order: applied in this order once redriven)")
		for _, g := range l.Held {
			fmt.Fprintf(w, "  %s\n", g.Group)
			for i, m := range g.Messages {
				fmt.Fprintf(w, "    %d. %s seq %d (%s)\n", i+1, m.Key, m.Sequence, m.Class)
			}
			if g.More > 0 {
				fmt.Fprintf(w, "    ... and %d more\n", g.More)
			}
		}
	}
}

func printMessages(w io.Writer, msgs []transport.DLQMessage) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  KEY\tGROUP\tTYPE\tSEQ\tCLASS\tDEAD AT\tREASON")
	for _, m := range msgs {
		dead := "-"
		if m.DeadAt != nil {
			dead = m.DeadAt.UTC().Format(time.RFC3339)
		}
		class := m.ErrorClass
		if class == "" {
			class = "-"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\t%s\t%s\t%s\n", m.Key, m.Group, orDash(m.EventType), m.Sequence, class, dead, oneLine(m.ErrorReason, 100))
	}
	_ = tw.Flush()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// oneLine is s on one line, cut at a word boundary to at most n characters.
func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) <= n {
		return s
	}
	cut := strings.LastIndexByte(s[:n], ' ')
	if cut < n/2 {
		cut = n - 1
	}
	return s[:cut] + " …"
}

// progress reports a long operation's advance on stderr: redrawn in place
// on a terminal, else plain lines at most every few seconds (logs, CI). A
// count past the total counted at the start (messages that arrived since)
// shows without a percentage, never above 100 %.
type progress struct {
	w     io.Writer
	tty   bool
	mu    sync.Mutex
	last  time.Time
	open  bool   // a redrawn line is waiting for its newline
	op    string // the operation on that line
	every time.Duration
}

func (a *app) progress() func(op string, done, total int64) {
	if a.jsonOut {
		return nil
	}
	a.prog = &progress{w: a.errOut, tty: a.interactive, every: 2 * time.Second}
	return a.prog.report
}

func (p *progress) report(op string, done, total int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	line := fmt.Sprintf("%s: %d", op, done)
	final := false
	if total > 0 && done <= total {
		line = fmt.Sprintf("%s: %d/%d (%d%%)", op, done, total, done*100/total)
		final = done == total
	}
	if p.tty {
		if p.open && p.op != op {
			fmt.Fprintln(p.w)
		}
		fmt.Fprintf(p.w, "\r\033[K%s", line)
		p.open, p.op = true, op
		if final {
			fmt.Fprintln(p.w)
			p.open = false
		}
		return
	}
	if !final && time.Since(p.last) < p.every {
		return
	}
	p.last = time.Now()
	fmt.Fprintln(p.w, line)
}

// finish ends a redrawn line.
func (p *progress) finish() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.open {
		fmt.Fprintln(p.w)
		p.open = false
	}
}
