package transporttest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// child is a consumer process (the test binary re-executed, see Main).
type child struct {
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{} // closed when the process has ended
}

// exited reports whether the process ended by itself (or was killed).
func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func (w *world) spawn(consumer string, delay time.Duration) *child {
	w.t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"=1", envSpec+"="+w.dep.Spec(), envDB+"="+w.db.URL, envConsumer+"="+consumer,
		fmt.Sprintf("%s=%d", envDelay, delay.Milliseconds()))
	c := &child{cmd: cmd, out: &syncBuffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = c.out, c.out
	if err := cmd.Start(); err != nil {
		w.t.Fatal(err)
	}
	go func() { _ = cmd.Wait(); close(c.done) }()
	w.t.Cleanup(func() {
		if !c.exited() {
			_ = cmd.Process.Kill()
			<-c.done
		}
		if w.t.Failed() {
			w.t.Logf("consumer process %d output:\n%s", cmd.Process.Pid, lastLines(c.out.String(), 30))
		}
	})
	return c
}

// kill SIGKILLs the process: no deferred code, no clean shutdown.
func (c *child) kill(t *testing.T) {
	t.Helper()
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil && !c.exited() {
		t.Fatal(err)
	}
	<-c.done
}

func lastLines(s string, n int) string {
	lines := bytes.Split([]byte(s), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// The consumer process is SIGKILLed mid-batch, while an aggregate waits
// for a retry with its later events parked behind it, and started again:
// every event is applied exactly once, every aggregate in order (the
// retrying one too: the park outlived the process).
func testKilledAndRestarted(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{Retry: transport.RetryPolicy{MaxRetries: 3, InitialDelay: transport.Duration(time.Second),
		Multiplier: 2, MaxDelay: transport.Duration(4 * time.Second)}})
	retrying := events("R", 1, 6)
	w.plan(retrying[0], 2) // parked for 1s, then 2s
	lists := [][]envelope.Envelope{retrying}
	all := append([]envelope.Envelope(nil), retrying...)
	for i := 0; i < 8; i++ {
		l := events(fmt.Sprintf("agg-%d", i), 1, 15)
		lists = append(lists, l)
		all = append(all, l...)
	}
	first := w.spawn("c1", 15*time.Millisecond)
	w.publish(interleave(lists...)...)
	w.eventually(60*time.Second, "R parked behind its failed first event, 30 others applied", func() bool {
		return w.count(`SELECT count(*) FROM inbox_parked WHERE consumer = 'c1' AND group_id = 'R'`) == 1 &&
			w.count(`SELECT count(*) FROM applied`) >= 30
	})
	first.kill(t)
	before := w.count(`SELECT count(*) FROM applied`)
	if got := w.seqs("c1", "R"); len(got) != 0 {
		t.Fatalf("R applied %v before its retrying first event", got)
	}
	if before == len(all) {
		t.Fatalf("everything was applied before the kill; the test proves nothing")
	}
	w.spawn("c1", 15*time.Millisecond)
	w.waitApplied("c1", len(all), 90*time.Second)
	time.Sleep(500 * time.Millisecond) // a late duplicate would show
	w.checkOnceInOrder("c1", all)
	t.Logf("%d of %d events applied when the consumer was killed", before, len(all))
}

// Every broker connection (publisher, consumer, its settling connection) is
// cut twice while events flow: all reconnect on their own, and every event
// is applied once, in order.
func testConnectionCut(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{})
	var lists [][]envelope.Envelope
	for i := 0; i < 20; i++ {
		lists = append(lists, events(fmt.Sprintf("agg-%d", i), 1, 10))
	}
	all := interleave(lists...)
	w.start("c1", w.db.Pool, 2*time.Millisecond, inbox.ConsumerConfig{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < len(all); i += 20 {
			w.publish(all[i:min(i+20, len(all))]...)
			time.Sleep(100 * time.Millisecond)
		}
	}()
	time.Sleep(300 * time.Millisecond)
	if n := w.dep.CutConnections(t); n < 2 {
		t.Fatalf("cut %d connections, want at least the publisher's and the consumer's", n)
	}
	time.Sleep(500 * time.Millisecond)
	w.dep.CutConnections(t)
	<-done
	w.waitApplied("c1", len(all), 90*time.Second)
	time.Sleep(300 * time.Millisecond)
	w.checkOnceInOrder("c1", all)
}

// PostgreSQL is unreachable (a proxy in front of it is cut and refuses
// connections) for ten times the whole retry budget while events arrive:
// nothing is retried or dead-lettered for it, and once it answers again
// every event is applied once, in order.
func testDatabaseDown(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{}) // 2 retries, 100ms then 200ms: a 300ms budget
	pool, px := w.proxiedPool()
	var lists [][]envelope.Envelope
	for i := 0; i < 10; i++ {
		lists = append(lists, events(fmt.Sprintf("agg-%d", i), 1, 6))
	}
	all := interleave(lists...)
	w.start("c1", pool, 0, inbox.ConsumerConfig{})
	w.publish(all[:20]...)
	w.waitApplied("c1", 20, 60*time.Second)
	px.Down()
	w.publish(all[20:]...)
	time.Sleep(3 * time.Second)
	if n := w.count(`SELECT count(*) FROM applied`); n != 20 {
		t.Fatalf("%d applied while the database was unreachable to the consumer", n)
	}
	px.Up()
	w.waitApplied("c1", len(all), 60*time.Second)
	time.Sleep(300 * time.Millisecond)
	w.checkOnceInOrder("c1", all)
	if bad := w.settlements(func(s inbox.Settlement) bool {
		return s.Action != inbox.ActionApplied && s.Action != inbox.ActionDuplicate
	}); len(bad) != 0 {
		t.Errorf("%d settlements other than applied (first: %s %s): the outage spent retry budget", len(bad), bad[0].Action, bad[0].Class)
	}
	if d := w.depth("c1"); d.DLQ != 0 {
		t.Errorf("%d dead-lettered during the outage", d.DLQ)
	}
	if n := w.count(`SELECT count(*) FROM inbox_parked`) + w.count(`SELECT count(*) FROM inbox_held`); n != 0 {
		t.Errorf("%d parked or held rows after the outage", n)
	}
}

// A crash loop: the consumer process is SIGKILLed again and again, each
// time while it is applying (first mid-batch, then while it runs the
// records its predecessor left unsettled), more times than the retry
// budget allows failures. Nothing is dead-lettered: a kill is no event's
// failure; every event is applied once, in order.
func testCrashLoop(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{}) // 2 retries
	var lists [][]envelope.Envelope
	for i := 0; i < 8; i++ {
		lists = append(lists, events(fmt.Sprintf("agg-%d", i), 1, 25))
	}
	all := interleave(lists...)
	w.publish(all...)
	const kills = 6 // > MaxRetries+1: a budget spent by kills would dead-letter
	for k := 0; k < kills; k++ {
		before := w.count(`SELECT count(*) FROM applied`)
		c := w.spawn("c1", 20*time.Millisecond)
		w.eventually(90*time.Second, fmt.Sprintf("consumer %d applying", k+1), func() bool {
			return w.count(`SELECT count(*) FROM applied`) >= before+10
		})
		c.kill(t)
	}
	killedAt := w.count(`SELECT count(*) FROM applied`)
	if killedAt >= len(all) {
		t.Fatalf("everything was applied before the last kill; the test proves nothing")
	}
	w.spawn("c1", 5*time.Millisecond)
	w.waitApplied("c1", len(all), 120*time.Second)
	time.Sleep(500 * time.Millisecond)
	w.checkOnceInOrder("c1", all)
	if d := w.depth("c1"); d.DLQ != 0 {
		t.Errorf("%d dead-lettered by a crash loop of healthy events", d.DLQ)
	}
	if n := w.count(`SELECT count(*) FROM inbox_held`) + w.count(`SELECT count(*) FROM inbox_parked`); n != 0 {
		t.Errorf("%d held or parked rows left", n)
	}
	t.Logf("%d kills; %d of %d events applied by then", kills, killedAt, len(all))
}

// An event whose side effect ends the consumer process every time (a
// segfault, an out-of-memory kill): a redelivered record runs alone after
// a committed charge, so its deaths are counted against it and no other
// event: after the retry budget it is dead-lettered without running again,
// its aggregate held behind it (strict order), and every other event is
// applied once, in order, whatever batches it shared with the poison one.
func testEventKillingTheConsumer(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{}) // 2 retries
	poison := events("P", 1, 3)
	w.planCrash(poison[0])
	lists := [][]envelope.Envelope{poison}
	var others []envelope.Envelope
	for i := 0; i < 4; i++ {
		l := events(fmt.Sprintf("agg-%d", i), 1, 10)
		lists = append(lists, l)
		others = append(others, l...)
	}
	w.publish(interleave(lists...)...)
	deaths := 0
	deadline := time.Now().Add(150 * time.Second)
	for {
		c := w.spawn("c1", 2*time.Millisecond)
		for !c.exited() && time.Now().Before(deadline) &&
			(w.count(`SELECT count(*) FROM inbox_held WHERE group_id = 'P'`) < len(poison) || w.count(`SELECT count(*) FROM applied`) < len(others)) {
			time.Sleep(50 * time.Millisecond)
		}
		if !c.exited() {
			break
		}
		deaths++
		if time.Now().After(deadline) || deaths > 10 {
			t.Fatalf("the consumer died %d times; P/1 was never dead-lettered (held rows %d)", deaths,
				w.count(`SELECT count(*) FROM inbox_held WHERE group_id = 'P'`))
		}
	}
	w.waitApplied("c1", len(others), 60*time.Second)
	w.checkOnceInOrder("c1", others)
	if got := w.seqs("c1", "P"); len(got) != 0 {
		t.Errorf("P applied %v", got)
	}
	var class string
	if err := w.db.Pool.QueryRow(context.Background(), `SELECT class FROM inbox_held WHERE group_id = 'P' AND message_key = $1`, poison[0].ID).Scan(&class); err != nil || class != inbox.ClassExhausted {
		t.Errorf("P/1's hold: class %q (%v), want exhausted", class, err)
	}
	w.eventually(60*time.Second, "P's three events in the DLQ", func() bool { return w.depth("c1").DLQ == int64(len(poison)) })
	// The first death comes from a first delivery (not charged: it may
	// have shared a batch), then one per charged attempt, until its
	// failures pass the budget of 2 retries.
	if deaths < 3 || deaths > 4 {
		t.Errorf("the consumer died %d times; want 3 (2 retries spent by charged deaths) or 4 (the first delivery uncharged)", deaths)
	}
	t.Logf("the consumer died %d times before P/1 was dead-lettered", deaths)
}

// The database is unreachable for several Lambda invocations in a row,
// more than the retry budget has attempts, while events wait: each
// invocation hands its records back (or fails, and the event source
// redelivers them), nothing is counted against them or dead-lettered, and
// once the database answers every event is applied once, in order.
func testDatabaseDownAcrossInvocations(t *testing.T, h Harness) {
	if h.Features.Lambda == nil {
		t.Skipf("%s has no Lambda consumer", h.Name)
	}
	w := newWorld(t, h, Options{}) // 2 retries: 3 attempts
	pool, px := w.proxiedPool()
	var lists [][]envelope.Envelope
	for i := 0; i < 6; i++ {
		lists = append(lists, events(fmt.Sprintf("agg-%d", i), 1, 3))
	}
	all := interleave(lists...)
	w.publish(all...)
	cc := w.consumerConfig(inbox.ConsumerConfig{Consumer: "c1", DeadlineMargin: 300 * time.Millisecond})
	src := h.Features.Lambda(t, w.dep, "c1", pool, sideEffect("c1", 0, w.planDB), cc)
	px.Down()
	invoked := 0
	for i := 0; i < 20 && invoked < 6; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		n, _ := src.Invoke(ctx, len(all)) // an error is the whole batch redelivered (Amazon MQ)
		cancel()
		if n > 0 {
			invoked++
		}
	}
	if invoked < 6 {
		t.Fatalf("only %d invocations had records while the database was down", invoked)
	}
	if n := w.count(`SELECT count(*) FROM applied`); n != 0 {
		t.Fatalf("%d applied while the database was unreachable to the consumer", n)
	}
	px.Up()
	for i := 0; i < 60 && w.count(`SELECT count(*) FROM applied`) < len(all); i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if _, err := src.Invoke(ctx, len(all)); err != nil {
			cancel()
			t.Fatalf("invocation after the outage: %v", err)
		}
		cancel()
	}
	w.checkOnceInOrder("c1", all)
	if bad := w.settlements(func(s inbox.Settlement) bool {
		return s.Action == inbox.ActionDeadLetter || s.Action == inbox.ActionHeld || s.Action == inbox.ActionRetry || s.Failures != 0
	}); len(bad) != 0 {
		t.Errorf("%d settlements spent retry budget (first: %s %s, %d failures)", len(bad), bad[0].Action, bad[0].Class, bad[0].Failures)
	}
	if d := w.depth("c1"); d.DLQ != 0 {
		t.Errorf("%d dead-lettered during the outage", d.DLQ)
	}
	if n := w.count(`SELECT count(*) FROM inbox_parked`) + w.count(`SELECT count(*) FROM inbox_held`); n != 0 {
		t.Errorf("%d parked or held rows after the outage", n)
	}
	t.Logf("%d invocations during the outage", invoked)
}

// A side effect slower than the broker's redelivery timeout: 60 events of
// one aggregate, 150ms each, AckWait 2s: the reproduction (before
// the engine kept queued records in progress: 114 duplicate deliveries,
// highest delivery count 5). The values make every kind of waiting outlive
// the ack wait: a lane's batch of 16 takes 2.4s, so the running batch's
// last records and every record queued behind it (the 60 take about 9s, 4
// ack waits) would be redelivered unless the consumer keeps them in
// progress (NATS: InProgress every AckWait/4; SQS: the visibility timeout
// extended). Keeping only the running record alive gives 136 duplicates
// here. Nothing the consumer holds, queued or running, is delivered again:
// no duplicates, no redeliveries, order kept.
func testSlowSideEffect(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{AckWait: 2 * time.Second})
	evs := events("hot", 1, 60)
	w.start("c1", w.db.Pool, 150*time.Millisecond, inbox.ConsumerConfig{})
	w.publish(evs...)
	w.waitApplied("c1", len(evs), 120*time.Second)
	time.Sleep(time.Second)
	w.checkOnceInOrder("c1", evs)
	if dup := w.settlements(func(s inbox.Settlement) bool { return s.Action == inbox.ActionDuplicate }); len(dup) != 0 {
		t.Errorf("%d duplicate deliveries", len(dup))
	}
	redelivered := w.settlements(func(s inbox.Settlement) bool { return s.Deliveries > 1 })
	if len(redelivered) != 0 {
		t.Errorf("%d events delivered more than once (highest %d)", len(redelivered), slices.MaxFunc(redelivered, func(a, b inbox.Settlement) int { return a.Deliveries - b.Deliveries }).Deliveries)
	}
	if !h.Features.RedeliveryTimeout {
		t.Logf("%s has no redelivery timeout; checked for duplicates only", h.Name)
	}
}

// A Lambda invocation that reaches its deadline stops starting events
// DeadlineMargin before it, returns in time, and has only what it did not
// finish delivered again, behind nothing newer of its aggregates: the next
// invocations apply the rest, each event once, in order, nothing
// dead-lettered.
func testLambdaDeadline(t *testing.T, h Harness) {
	if h.Features.Lambda == nil {
		t.Skipf("%s has no Lambda consumer", h.Name)
	}
	w := newWorld(t, h, Options{})
	var lists [][]envelope.Envelope
	for i := 0; i < 10; i++ {
		lists = append(lists, events(fmt.Sprintf("agg-%d", i), 1, 3))
	}
	all := interleave(lists...)
	w.publish(all...)
	// A lane's share takes longer than the invocation has: 200ms an event,
	// ten aggregates over four lanes (RabbitMQ), or ten records of one
	// receive on SQS's single lane (an SQS FIFO receive returns one record
	// per group here).
	cc := w.consumerConfig(inbox.ConsumerConfig{Consumer: "c1", DeadlineMargin: 500 * time.Millisecond})
	src := h.Features.Lambda(t, w.dep, "c1", w.db.Pool, sideEffect("c1", 200*time.Millisecond, w.planDB), cc)
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	start := time.Now()
	n, err := src.Invoke(ctx, len(all))
	took := time.Since(start)
	cancel()
	if err != nil {
		t.Fatalf("the invocation near its deadline failed: %v", err)
	}
	if took > 1500*time.Millisecond {
		t.Fatalf("the invocation took %s, past its 1.5s deadline", took)
	}
	applied := w.count(`SELECT count(*) FROM applied`)
	if n == 0 || applied == 0 || applied >= n {
		t.Fatalf("first invocation: %d records, %d applied; want some, not all", n, applied)
	}
	deferred := w.settlements(func(s inbox.Settlement) bool { return s.Action == inbox.ActionDeferred })
	for _, s := range deferred {
		if s.Failures != 0 {
			t.Errorf("a record not finished before the deadline counts %d failures", s.Failures)
		}
	}
	for i := 0; i < 60 && w.count(`SELECT count(*) FROM applied`) < len(all); i++ {
		ictx, icancel := context.WithTimeout(context.Background(), 30*time.Second)
		if _, err := src.Invoke(ictx, len(all)); err != nil {
			icancel()
			t.Fatalf("invocation: %v", err)
		}
		icancel()
	}
	w.checkOnceInOrder("c1", all)
	if d := w.depth("c1"); d.DLQ != 0 {
		t.Errorf("%d dead-lettered", d.DLQ)
	}
	t.Logf("first invocation: %d records in %s, %d applied, %d handed back", n, took.Round(time.Millisecond), applied, len(deferred))
}
