package redrive_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// pipeline is the whole local flow: outbox -> dispatcher -> SNS FIFO (emulator)
// -> SQS FIFO queues -> inbox handlers of the default topology's consumers,
// each recording what it applied in table applied.
type pipeline struct {
	db     *pgtest.DB
	env    *emulatortest.Env
	svc    *redrive.Service
	mu     sync.Mutex
	poison map[string]bool // event ids the audit consumer rejects permanently
}

func newPipeline(t *testing.T) *pipeline {
	t.Helper()
	p := &pipeline{db: pgtest.New(t), poison: map[string]bool{}}
	p.env = emulatortest.New(t, topology.Default(), 6)
	deleteSubscriptionDLQs(t, p.env)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	if _, err := p.db.Pool.Exec(ctx, `CREATE TABLE applied (n bigserial PRIMARY KEY, consumer text, event_id uuid, aggregate_id text, seq bigint)`); err != nil {
		t.Fatal(err)
	}
	queues := sns.Queues{}
	for name, q := range p.env.Queues {
		queues[name] = sns.QueueURLs{QueueURL: q.URL, DLQURL: q.DLQURL, SubscriptionDLQURL: q.SubDLQURL}
		name, q := name, q
		apply := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
			p.mu.Lock()
			bad := name == "audit" && p.poison[e.ID]
			p.mu.Unlock()
			if bad {
				return envelope.Permanent(errors.New("audit rejects this event"))
			}
			_, err := tx.Exec(ctx, `INSERT INTO applied (consumer, event_id, aggregate_id, seq) VALUES ($1, $2, $3, $4)`, name, e.ID, e.AggregateID, e.Sequence)
			return err
		}
		h, err := sns.NewHandler(p.db.Pool, p.env.SQS, apply, sns.HandlerConfig{Consumer: name, DLQURL: q.DLQURL, Logger: quiet,
			MaxReceiveCount: q.Consumer.MaxReceiveCount})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = (&sns.Runner{SQS: p.env.SQS, QueueURL: q.URL, QueueARN: q.ARN, Handler: h.Handle, RetryDelay: time.Second, Logger: quiet}).Run(ctx)
		}()
	}
	pub, err := sns.NewPublisher(p.env.SNS, sns.PublisherConfig{TopicARN: p.env.TopicARN})
	if err != nil {
		t.Fatal(err)
	}
	d, err := outbox.NewDispatcher(p.db.Pool, pub, outbox.DispatcherConfig{PollInterval: 20 * time.Millisecond, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	wg.Add(1)
	go func() { defer wg.Done(); _ = d.Run(ctx) }()
	p.svc, err = redrive.New(p.db.Pool, redrive.Config{Operations: snsOps(t, p.env, queues, nil), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func (p *pipeline) count(t *testing.T, consumer string) int {
	t.Helper()
	var n int
	if err := p.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM applied WHERE consumer = $1`, consumer).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (p *pipeline) waitFor(t *testing.T, want map[string]int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok := true
		got := map[string]int{}
		for c, n := range want {
			got[c] = p.count(t, c)
			ok = ok && got[c] >= n
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("applied %v, want %v", got, want)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitSent waits until the dispatcher has recorded every event as sent: a
// consumer can apply an event before the mark that records its publish
// commits, and replay selects sent events only.
func (p *pipeline) waitSent(t *testing.T, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		var unsent int
		if err := p.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events WHERE state <> 'sent'`).Scan(&unsent); err != nil {
			t.Fatal(err)
		}
		if unsent == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d events not recorded as sent", unsent)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Replay reaches only the chosen consumer and re-applies exactly the events
// of the chosen aggregate type and time range, in sequence order.
func TestReplayReachesOnlyTheChosenConsumer(t *testing.T) {
	p := newPipeline(t)
	ctx := context.Background()
	var early, late []envelope.Envelope
	for o := 0; o < 10; o++ {
		for _, typ := range []string{"order.placed", "order.paid", "order.shipped"} {
			early = append(early, event("order", fmt.Sprintf("o-%d", o), typ))
		}
	}
	for i := 0; i < 5; i++ {
		early = append(early, event("payment", fmt.Sprintf("p-%d", i), "payment.captured"))
	}
	enqueue(t, p.db, early...)
	time.Sleep(20 * time.Millisecond)
	since := time.Now()
	time.Sleep(20 * time.Millisecond)
	for o := 10; o < 15; o++ {
		for _, typ := range []string{"order.placed", "order.paid"} {
			late = append(late, event("order", fmt.Sprintf("o-%d", o), typ))
		}
	}
	late = append(late, event("payment", "p-9", "payment.captured")) // late but not an order: not replayed
	enqueue(t, p.db, late...)
	// orders-projection: every order event (40); shipping: order.paid (15); audit: all (46).
	before := map[string]int{"orders-projection": 40, "shipping": 15, "audit": 46}
	p.waitFor(t, before, time.Minute)
	p.waitSent(t, time.Minute)

	res, err := p.svc.Execute(ctx, redrive.Command{Operation: redrive.OpReplay, Consumer: "orders-projection", AggregateType: "order", Since: &redrive.Instant{Time: since}, DryRun: true})
	if err != nil || res.Affected != 10 || res.Aggregates != 5 {
		t.Fatalf("dry run %+v %v", res, err)
	}
	res, err = p.svc.Execute(ctx, redrive.Command{Operation: redrive.OpReplay, Consumer: "orders-projection", AggregateType: "order", Since: &redrive.Instant{Time: since}, Actor: "test"})
	if err != nil || res.Affected != 10 {
		t.Fatalf("replay %+v %v", res, err)
	}
	p.waitFor(t, map[string]int{"orders-projection": 50}, time.Minute)
	time.Sleep(2 * time.Second) // anything stray would show up by now
	for c, n := range map[string]int{"orders-projection": 50, "shipping": 15, "audit": 46} {
		if got := p.count(t, c); got != n {
			t.Fatalf("%s applied %d, want %d", c, got, n)
		}
	}
	// Exactly the late order events were applied twice, each aggregate in order.
	rows, err := p.db.Pool.Query(ctx, `SELECT event_id::text, aggregate_id, seq FROM applied WHERE consumer = 'orders-projection' ORDER BY n`)
	if err != nil {
		t.Fatal(err)
	}
	times := map[string]int{}
	lastSeq := map[string]int64{}
	second := false
	for rows.Next() {
		var id, agg string
		var seq int64
		if err := rows.Scan(&id, &agg, &seq); err != nil {
			t.Fatal(err)
		}
		times[id]++
		if times[id] == 2 {
			second = true
			if seq != lastSeq[agg]+1 && !(seq == 1) {
				t.Fatalf("replayed %s seq %d after %d", agg, seq, lastSeq[agg])
			}
		}
		lastSeq[agg] = seq
	}
	if !second {
		t.Fatal("nothing re-applied")
	}
	for _, e := range late[:10] {
		if times[e.ID] != 2 {
			t.Fatalf("late event %s applied %d times, want 2", e.ID, times[e.ID])
		}
	}
	for _, e := range early {
		if e.AggregateType == "order" && times[e.ID] != 1 {
			t.Fatalf("early event %s applied %d times, want 1", e.ID, times[e.ID])
		}
	}
	audit, _ := redrive.ListAudit(ctx, p.db.Pool, 1)
	if len(audit) != 1 || audit[0].Operation != "replay" || audit[0].Affected != 10 || audit[0].Status != "done" {
		t.Fatalf("audit %+v", audit)
	}
}

// Messages in a consumer's DLQ go back to its queue and are applied once,
// in order: the audit consumer (strict order, the default) holds each
// aggregate behind its rejected event, and redrive applies the aggregate's
// events in sequence order and ends the hold.
func TestDLQRedriveAppliesOnce(t *testing.T) {
	p := newPipeline(t)
	ctx := context.Background()
	var evs []envelope.Envelope
	for i := 0; i < 12; i++ {
		e := event("order", fmt.Sprintf("o-%d", i%4), "order.placed")
		if i%3 == 0 {
			p.poison[e.ID] = true
		}
		evs = append(evs, e)
	}
	enqueue(t, p.db, evs...)
	// Rejected: o-0/1, o-3/1, o-2/2, o-1/3. Held behind them: o-0/2, o-0/3,
	// o-3/2, o-3/3, o-2/3. Applied: o-1/1, o-1/2, o-2/1.
	p.waitFor(t, map[string]int{"audit": 3, "orders-projection": 12}, time.Minute)
	var st redrive.Result
	deadline := time.Now().Add(30 * time.Second)
	for {
		var err error
		st, err = p.svc.Execute(ctx, redrive.Command{Operation: redrive.OpStatus, Consumer: "audit"})
		if err != nil {
			t.Fatal(err)
		}
		if len(st.Status.Queues.Consumers) == 1 && st.Status.Queues.Consumers[0].DLQ == 9 && st.Status.Queues.Consumers[0].HeldGroups == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("DLQ depth: %+v", st.Status)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if n := p.count(t, "audit"); n != 3 {
		t.Fatalf("audit applied %d events while its aggregates were held, want 3", n)
	}
	dry, err := p.svc.Execute(ctx, redrive.Command{Operation: redrive.OpDLQRedrive, Consumer: "audit", DryRun: true})
	if err != nil || dry.Affected != 9 {
		t.Fatalf("dry run %+v %v", dry, err)
	}
	p.mu.Lock()
	p.poison = map[string]bool{} // fixed
	p.mu.Unlock()
	var progress []int64
	svcProgress, _ := redrive.New(p.db.Pool, redrive.Config{Operations: snsOps(t, p.env, queuesOf(p), nil), Logger: quiet,
		Progress: func(op string, done, total int64) { progress = append(progress, done) }})
	res, err := svcProgress.Execute(ctx, redrive.Command{Operation: redrive.OpDLQRedrive, Consumer: "audit", Actor: "test"})
	if err != nil || res.Affected != 9 {
		t.Fatalf("redrive %+v %v", res, err)
	}
	if len(progress) == 0 || progress[len(progress)-1] != 9 {
		t.Fatalf("progress %v", progress)
	}
	p.waitFor(t, map[string]int{"audit": 12}, time.Minute)
	again, err := svcProgress.Execute(ctx, redrive.Command{Operation: redrive.OpDLQRedrive, Consumer: "audit", Actor: "test"})
	if err != nil || again.Affected != 0 {
		t.Fatalf("second redrive %+v %v", again, err)
	}
	time.Sleep(2 * time.Second)
	var dupes int
	if err := p.db.Pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT event_id FROM applied WHERE consumer = 'audit' GROUP BY event_id HAVING count(*) > 1) d`).Scan(&dupes); err != nil {
		t.Fatal(err)
	}
	if n := p.count(t, "audit"); n != 12 || dupes != 0 {
		t.Fatalf("audit applied %d (%d duplicated), want 12 once each", n, dupes)
	}
	if n := p.count(t, "orders-projection"); n != 12 {
		t.Fatalf("orders-projection applied %d, want 12 (untouched)", n)
	}
	assertInOrder(t, p.db, "audit")
	st, _ = p.svc.Execute(ctx, redrive.Command{Operation: redrive.OpStatus, Consumer: "audit"})
	if q := st.Status.Queues.Consumers[0]; q.HeldGroups != 0 || q.HeldMessages != 0 {
		t.Fatalf("holds left after the redrive: %+v", q)
	}
	audit, _ := redrive.ListAudit(ctx, p.db.Pool, 5)
	// Newest first: the second (empty) redrive, the redrive, the dry run.
	if len(audit) != 3 || audit[1].Affected != 9 || audit[1].Status != "done" || !audit[2].DryRun || audit[2].Affected != 9 {
		t.Fatalf("audit %+v", audit)
	}
}

func queuesOf(p *pipeline) sns.Queues {
	q := sns.Queues{}
	for name, x := range p.env.Queues {
		q[name] = sns.QueueURLs{QueueURL: x.URL, DLQURL: x.DLQURL, SubscriptionDLQURL: x.SubDLQURL}
	}
	return q
}

// deleteSubscriptionDLQs removes the subscription DLQs a test provisioned
// (emulatortest deletes the queues and consumer DLQs).
func deleteSubscriptionDLQs(t *testing.T, env *emulatortest.Env) {
	t.Cleanup(func() {
		for _, q := range env.Queues {
			_, _ = env.SQS.DeleteQueue(context.Background(), &sqs.DeleteQueueInput{QueueUrl: aws.String(q.SubDLQURL)})
		}
	})
}

// assertInOrder checks that the consumer applied every aggregate's events
// once each, in sequence order.
func assertInOrder(t *testing.T, db *pgtest.DB, consumer string) {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT aggregate_id, seq FROM applied WHERE consumer = $1 ORDER BY n`, consumer)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	last := map[string]int64{}
	for rows.Next() {
		var agg string
		var seq int64
		if err := rows.Scan(&agg, &seq); err != nil {
			t.Fatal(err)
		}
		if seq != last[agg]+1 {
			t.Fatalf("%s applied %s/%d after %s/%d", consumer, agg, seq, agg, last[agg])
		}
		last[agg] = seq
	}
}

// snsOps is the SNS transport's operations on env's queues.
func snsOps(t *testing.T, env *emulatortest.Env, queues sns.Queues, topo *topology.Topology) transport.Operations {
	t.Helper()
	tr, err := sns.New(sns.Config{SNS: env.SNS, SQS: env.SQS, Queues: queues, Topology: topo, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	ops, err := tr.Operations()
	if err != nil {
		t.Fatal(err)
	}
	return ops
}
