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
	cmd *exec.Cmd
	out *syncBuffer
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
	c := &child{cmd: cmd, out: &syncBuffer{}}
	cmd.Stdout, cmd.Stderr = c.out, c.out
	if err := cmd.Start(); err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
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
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = c.cmd.Wait()
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

// A side effect slower than the broker's redelivery timeout: 60 events of
// one aggregate, 150ms each, AckWait 2s (a lane's batch of 16 takes 2.4s).
// Nothing the consumer holds, queued or running, is delivered again: no
// duplicates, no redeliveries, order kept.
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
