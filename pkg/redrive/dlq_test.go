package redrive_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/redrive"
)

// appliedSeqs is the order the consumer applied aggregate agg's events in.
func (p *oneConsumer) appliedSeqs(t *testing.T, agg string) []int64 {
	t.Helper()
	rows, err := p.db.Pool.Query(context.Background(), `SELECT seq FROM applied WHERE aggregate_id = $1 ORDER BY n`, agg)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var s int64
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	return out
}

// Strict order through a poison message, end to end (outbox -> dispatcher
// -> SNS -> SQS -> consumer -> DLQ): a/1 cannot be applied, so a/2 and a/3
// wait in the DLQ behind it and the group is held. The operator looks at
// the DLQ (nothing moves, nothing stays in flight), peeks at the poison
// message, discards it alone, and redrives: a/2 and a/3 are applied in
// order, a/1 never, and the hold ends.
func TestDiscardingAHeldGroupsPoisonMessageKeepsStrictOrder(t *testing.T) {
	p := newOneConsumer(t, true)
	ctx := context.Background()
	a := []envelope.Envelope{event("thing", "a", "thing.changed"), event("thing", "a", "thing.changed"), event("thing", "a", "thing.changed")}
	b := event("thing", "b", "thing.changed")
	p.mu.Lock()
	p.reject[a[0].ID] = envelope.Permanent(errors.New("poison: currency XXX"))
	p.mu.Unlock()
	enqueue(t, p.db, a[0], b, a[1], a[2])
	p.until(t, "b applied, a/1-3 in the DLQ, a held", func() bool {
		q := p.status(t)
		return p.applied(t) == 1 && q.DLQ == 3 && q.HeldGroups == 1 && q.HeldMessages == 3
	})
	exec := func(cmd redrive.Command) redrive.Result {
		t.Helper()
		cmd.Consumer, cmd.Actor = "c", "test"
		res, err := p.svc.Execute(ctx, cmd)
		if err != nil {
			t.Fatalf("%s: %v", cmd.Operation, err)
		}
		return res
	}
	unchanged := func(what string) {
		t.Helper()
		if q := p.status(t); q.DLQ != 3 || q.DLQInFlight != 0 || q.HeldMessages != 3 {
			t.Fatalf("after %s: %+v, want the DLQ's 3 visible and none in flight", what, q)
		}
	}

	l := exec(redrive.Command{Operation: redrive.OpDLQList})
	if l.DLQ == nil || l.DLQ.Total != 3 || len(l.DLQ.Messages) == 0 || l.DLQ.Messages[0].Key != a[0].ID ||
		l.DLQ.Messages[0].ErrorClass != "permanent" || !strings.Contains(l.DLQ.Messages[0].ErrorReason, "currency XXX") || l.DLQ.Messages[0].Body != "" {
		t.Fatalf("dlq list %+v", l.DLQ)
	}
	if h := l.DLQ.Held; len(h) != 1 || h[0].Group != "a" || len(h[0].Messages) != 3 || h[0].Messages[0].Key != a[0].ID ||
		h[0].Messages[1].Key != a[1].ID || h[0].Messages[2].Key != a[2].ID {
		t.Fatalf("held groups %+v", h)
	}
	unchanged("dlq list")

	pk := exec(redrive.Command{Operation: redrive.OpDLQPeek, Messages: []string{a[0].ID}})
	if len(pk.DLQ.Messages) != 1 || !strings.Contains(pk.DLQ.Messages[0].Body, a[0].ID) || pk.AuditID == 0 {
		t.Fatalf("peek %+v", pk)
	}
	unchanged("dlq peek")

	dry := exec(redrive.Command{Operation: redrive.OpDLQDiscard, Messages: []string{a[0].ID}, Reason: "poison", DryRun: true})
	if dry.Affected != 1 {
		t.Fatalf("dry run %+v", dry)
	}
	unchanged("a dry run")

	res := exec(redrive.Command{Operation: redrive.OpDLQDiscard, Messages: []string{a[0].ID}, Reason: "poison: bad currency"})
	if res.Affected != 1 || !strings.Contains(res.Message, "1 held rows released") {
		t.Fatalf("discard %+v", res)
	}
	if q := p.status(t); q.DLQ != 2 || q.HeldMessages != 2 || q.HeldGroups != 1 {
		t.Fatalf("after the discard: %+v, want a/2 and a/3 left and still held", q)
	}
	time.Sleep(time.Second)
	if got := p.appliedSeqs(t, "a"); len(got) != 0 {
		t.Fatalf("a applied %v while held", got)
	}

	p.mu.Lock()
	p.reject = map[string]error{}
	p.mu.Unlock()
	if r := exec(redrive.Command{Operation: redrive.OpDLQRedrive}); r.Affected != 2 {
		t.Fatalf("redrive %+v", r)
	}
	p.until(t, "a/2 and a/3 applied", func() bool { return p.applied(t) == 3 })
	time.Sleep(time.Second)
	if got := p.appliedSeqs(t, "a"); len(got) != 2 || got[0] != 2 || got[1] != 3 {
		t.Fatalf("a applied in order %v, want [2 3]", got)
	}
	if q := p.status(t); q.HeldGroups != 0 || q.DLQ != 0 {
		t.Fatalf("after the redrive: %+v", q)
	}
	audit, _ := redrive.ListAudit(ctx, p.db.Pool, 10)
	var ops []string
	for _, a := range audit {
		ops = append(ops, a.Operation)
	}
	if strings.Join(ops, " ") != "redrive dlq-discard dlq-discard dlq-peek" {
		t.Fatalf("audited %v", ops)
	}
}
