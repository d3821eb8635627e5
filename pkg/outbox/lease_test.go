package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

// hangingMarkDB makes the first `hang` outcome writes hang until their
// statement's deadline (a server too slow to answer in MarkTimeout).
type hangingMarkDB struct {
	outbox.DB
	hang  int64
	marks atomic.Int64
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

func (h *hangingMarkDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if strings.Contains(sql, "outbox_mark_runs") && h.marks.Add(1) <= h.hang {
		<-ctx.Done()
		return errRow{fmt.Errorf("mark: %w", ctx.Err())}
	}
	return h.DB.QueryRow(ctx, sql, args...)
}

// A mark that times out is retried at once, with a fresh time limit: the
// batch is recorded in about two MarkTimeouts, not left to the lease.
func TestTimedOutMarkIsRetriedAtOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	var evs []envelope.Envelope
	for a := 0; a < 10; a++ {
		evs = append(evs, event(fmt.Sprintf("m-%d", a), 1), event(fmt.Sprintf("m-%d", a), 2))
	}
	enqueue(t, db.Pool, evs...)
	slow := &hangingMarkDB{DB: db.Pool, hang: 1}
	rec := &outboxtest.Recorder{}
	d := newDispatcher(t, slow, rec, outbox.DispatcherConfig{MarkTimeout: 300 * time.Millisecond})
	start := time.Now()
	res, err := d.RunOnce(ctx)
	took := time.Since(start)
	if err != nil {
		t.Fatalf("RunOnce: %v (the retried mark should have recorded the batch)", err)
	}
	if res.Sent != 20 || slow.marks.Load() != 2 {
		t.Fatalf("result %+v after %d mark attempts; want 20 sent in 2 attempts", res, slow.marks.Load())
	}
	if n := headCount(t, db.Pool, "claim_token IS NOT NULL"); n != 0 {
		t.Fatalf("%d heads still claimed", n)
	}
	if n := count(t, db.Pool, "state = 'sent'"); n != 20 {
		t.Fatalf("%d events sent, want 20", n)
	}
	if took > 2*time.Second {
		t.Fatalf("batch took %s", took)
	}
}

// A mark that fails twice releases the batch's runs: another dispatcher
// claims them at once (no lease to wait out) and publishes them again, in
// order; the only duplicates are the events the first batch published.
func TestUnrecordedBatchIsReleased(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	want := map[string]int{}
	var evs []envelope.Envelope
	for a := 0; a < 10; a++ {
		agg := fmt.Sprintf("r-%d", a)
		evs = append(evs, event(agg, 1), event(agg, 2))
		want[agg] = 2
	}
	enqueue(t, db.Pool, evs...)
	slow := &hangingMarkDB{DB: db.Pool, hang: 2}
	first := &outboxtest.Recorder{}
	d1 := newDispatcher(t, slow, first, outbox.DispatcherConfig{MarkTimeout: 300 * time.Millisecond})
	res, err := d1.RunOnce(ctx)
	if err == nil || !strings.Contains(err.Error(), "released") {
		t.Fatalf("RunOnce = %+v, %v; want an error saying the runs were released", res, err)
	}
	if n := headCount(t, db.Pool, "claim_token IS NOT NULL OR due_at > now()"); n != 0 {
		t.Fatalf("%d heads still leased after the release", n)
	}
	second := &outboxtest.Recorder{}
	d2 := newDispatcher(t, db.Pool, second, outbox.DispatcherConfig{})
	start := time.Now()
	if err := d2.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("released runs published again after %s", took)
	}
	dups := checkOrder(t, append(first.Acks(), second.Acks()...), want, true)
	if dups != first.Len() {
		t.Fatalf("%d duplicates; want exactly the %d events the unrecorded batch published", dups, first.Len())
	}
	if n := count(t, db.Pool, "state <> 'sent'"); n != 0 {
		t.Fatalf("%d events not sent", n)
	}
}

// failingClaimDB fails every third claim, as when connections are killed now
// and then: the database is reachable between failures.
type failingClaimDB struct {
	outbox.DB
	claims atomic.Int64
}

func (f *failingClaimDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if strings.Contains(sql, "outbox_claim_runs") && f.claims.Add(1)%3 == 0 {
		return nil, errors.New("FATAL: terminating connection due to administrator command (SQLSTATE 57P01)")
	}
	return f.DB.Query(ctx, sql, args...)
}

// retryLog records the retry_in of Run's "will retry" warnings.
type retryLog struct {
	mu    sync.Mutex
	waits []time.Duration
}

func (r *retryLog) Enabled(context.Context, slog.Level) bool { return true }
func (r *retryLog) Handle(_ context.Context, rec slog.Record) error {
	rec.Attrs(func(a slog.Attr) bool {
		if a.Key == "retry_in" {
			if d, err := time.ParseDuration(a.Value.String()); err == nil {
				r.mu.Lock()
				r.waits = append(r.waits, d)
				r.mu.Unlock()
			}
		}
		return true
	})
	return nil
}
func (r *retryLog) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *retryLog) WithGroup(string) slog.Handler      { return r }

// Run's retry backoff starts over once a batch succeeds: under repeated
// connection failures with successful claims between them it stays at its
// first step instead of climbing to 5 s.
func TestRunBackoffResetsAfterASuccessfulClaim(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var evs []envelope.Envelope
	for i := 1; i <= 4; i++ {
		for a := 0; a < 150; a++ {
			evs = append(evs, event(fmt.Sprintf("b-%03d", a), i))
		}
	}
	enqueue(t, db.Pool, evs...)
	log := &retryLog{}
	flaky := &failingClaimDB{DB: db.Pool}
	d := newDispatcher(t, flaky, &outboxtest.Recorder{}, outbox.DispatcherConfig{BatchSize: 10, Logger: slog.New(log)})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	for ctx.Err() == nil && count(t, db.Pool, "state <> 'sent'") > 0 {
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	<-done
	log.mu.Lock()
	defer log.mu.Unlock()
	if left := count(t, db.Pool, "state <> 'sent'"); left > 0 {
		t.Fatalf("%d events not sent in 20 s; backoffs %v", left, log.waits)
	}
	if len(log.waits) < 5 {
		t.Fatalf("only %d failures injected: the test did not exercise repeated failures", len(log.waits))
	}
	first := d.Config().PollInterval * 2
	for i, w := range log.waits {
		if w > first {
			t.Fatalf("retry %d waited %s after claims had succeeded in between; want %s (backoffs %v)", i, w, first, log.waits)
		}
	}
}
