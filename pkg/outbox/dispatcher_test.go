package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
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

func newDispatcher(t testing.TB, db outbox.DB, pub outbox.Publisher, cfg outbox.DispatcherConfig) *outbox.Dispatcher {
	t.Helper()
	d, err := outbox.NewDispatcher(db, pub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// Torture: 4 dispatchers, 500 aggregates, 20,000 events enqueued while they
// run, a publisher failing 20% of calls: everything is acknowledged exactly
// once and per-aggregate order holds.
func TestTortureConcurrentDispatchersWithFailures(t *testing.T) {
	t.Parallel()
	const aggregates, total, dispatchers = 500, 20000, 4
	db := pgtest.New(t)
	rec := &outboxtest.Recorder{FailRate: 0.2}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for i := 0; i < dispatchers; i++ {
		d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{
			BatchSize: 100, MaxAttempts: 1000, BackoffBase: time.Millisecond, BackoffCap: 20 * time.Millisecond,
			PollInterval: 5 * time.Millisecond, PublishConcurrency: 4,
		})
		wg.Add(1)
		go func() { defer wg.Done(); _ = d.Run(ctx) }()
	}

	// Producers: transactions of 1-10 events over random aggregates.
	want := map[string]int{}
	var mu sync.Mutex
	var pwg sync.WaitGroup
	produced := atomic.Int64{}
	for p := 0; p < 4; p++ {
		pwg.Add(1)
		go func() {
			defer pwg.Done()
			for produced.Load() < total {
				n := 1 + rand.IntN(10)
				if left := total - produced.Add(int64(n)) + int64(n); left < int64(n) {
					n = int(max(left, 0))
				}
				if n == 0 {
					return
				}
				evs := make([]envelope.Envelope, n)
				for i := range evs {
					evs[i] = event(fmt.Sprintf("agg-%03d", rand.IntN(aggregates)), i)
				}
				enqueue(t, db.Pool, evs...)
				mu.Lock()
				for _, e := range evs {
					want[e.AggregateID]++
				}
				mu.Unlock()
			}
		}()
	}
	pwg.Wait()
	wantTotal := 0
	for _, n := range want {
		wantTotal += n
	}
	if wantTotal != total {
		t.Fatalf("produced %d, want %d", wantTotal, total)
	}

	deadline := time.Now().Add(2 * time.Minute)
	for rec.Len() < total && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	cancel()
	wg.Wait()

	acks := rec.Acks()
	if len(acks) != total {
		t.Fatalf("acknowledged %d events, want %d", len(acks), total)
	}
	if dups := checkOrder(t, acks, want, false); dups != 0 {
		t.Fatalf("%d duplicates", dups)
	}
	if n := count(t, db.Pool, "state <> 'sent' OR claim_token IS NOT NULL"); n != 0 {
		t.Fatalf("%d rows not sent or still claimed", n)
	}
	var retried int
	_ = db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox WHERE attempts > 1").Scan(&retried)
	t.Logf("20%% failing publisher: %d of %d events needed retries", retried, total)
	if retried == 0 {
		t.Fatal("no event was retried: failure injection did not work")
	}
}

// A failing head retries with full-jitter exponential backoff, goes dead
// after MaxAttempts with its error, and parks only its own aggregate.
func TestBackoffDeadAndParking(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	poison := errors.New("broker says no")
	var failA atomic.Bool
	failA.Store(true)
	rec := &outboxtest.Recorder{Fail: func(m outbox.Message) error {
		if m.GroupID == "A" && m.Sequence == 1 && failA.Load() {
			return poison
		}
		return nil
	}}
	cfg := outbox.DispatcherConfig{BatchSize: 50, MaxAttempts: 4, BackoffBase: time.Second, BackoffCap: 3 * time.Second}
	d := newDispatcher(t, db.Pool, rec, cfg)
	for i := 1; i <= 3; i++ {
		enqueue(t, db.Pool, event("A", i), event("B", i))
	}

	for attempt := 1; attempt <= 4; attempt++ {
		// Drain: B moves one event per round (head-only), A's head fails.
		if _, err := d.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
		var state, lastErr string
		var attempts int
		var delay float64
		err := db.Pool.QueryRow(ctx, `SELECT state, attempts, coalesce(last_error,''), extract(epoch FROM next_attempt_at - now())
			FROM outbox WHERE aggregate_id = 'A' AND aggregate_seq = 1`).Scan(&state, &attempts, &lastErr, &delay)
		if err != nil {
			t.Fatal(err)
		}
		if attempts != attempt || lastErr != poison.Error() {
			t.Fatalf("attempt %d: attempts=%d last_error=%q", attempt, attempts, lastErr)
		}
		if attempt < 4 {
			ceiling := d.Config().BackoffCeiling(attempt).Seconds()
			if state != "pending" || delay < -0.5 || delay > ceiling+0.5 {
				t.Fatalf("attempt %d: state %s, next attempt in %.3fs, want pending within [0, %.1fs]", attempt, state, delay, ceiling)
			}
			// Make it due now instead of sleeping through the backoff.
			if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET next_attempt_at = now() WHERE aggregate_id = 'A' AND aggregate_seq = 1`); err != nil {
				t.Fatal(err)
			}
		} else if state != "dead" {
			t.Fatalf("after %d attempts state = %s, want dead", attempt, state)
		}
	}
	// B flowed completely; A's later events are parked behind the dead head.
	if n := count(t, db.Pool, "aggregate_id = 'B' AND state = 'sent'"); n != 3 {
		t.Fatalf("B sent = %d, want 3", n)
	}
	if n := count(t, db.Pool, "aggregate_id = 'A' AND state = 'pending' AND aggregate_seq > 1 AND attempts = 0"); n != 2 {
		t.Fatalf("A parked = %d, want 2 never attempted", n)
	}
	st, err := outbox.Stats(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if st.Dead != 1 || st.ParkedAggregates != 1 || st.Pending != 2 {
		t.Fatalf("stats = %+v, want dead 1, parked 1, pending 2", st)
	}
	// Once the dead event is re-queued and the broker recovers, A continues in order.
	failA.Store(false)
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET state = 'pending', attempts = 0, next_attempt_at = now() WHERE state = 'dead'`); err != nil {
		t.Fatal(err)
	}
	if err := d.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	for d.Totals().Sent < 6 {
		if _, err := d.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	checkOrder(t, rec.Acks(), map[string]int{"A": 3, "B": 3}, false)
}

// The retry delay is uniform in [0, ceiling] (full jitter), not a fixed value.
func TestBackoffIsFullJitter(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	const n = 300
	for i := 0; i < n; i++ {
		enqueue(t, db.Pool, event(fmt.Sprintf("j-%d", i), 1))
	}
	rec := &outboxtest.Recorder{Fail: func(outbox.Message) error { return errors.New("throttled") }}
	cfg := outbox.DispatcherConfig{BatchSize: n, MaxAttempts: 10, BackoffBase: 10 * time.Second, BackoffCap: time.Minute}
	d := newDispatcher(t, db.Pool, rec, cfg)
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	var mean, minD, maxD float64
	err := db.Pool.QueryRow(ctx, `SELECT avg(s), min(s), max(s) FROM (
		SELECT extract(epoch FROM next_attempt_at - now()) AS s FROM outbox) x`).Scan(&mean, &minD, &maxD)
	if err != nil {
		t.Fatal(err)
	}
	// Uniform on [0,10s]: mean ~5s; 300 samples keep it well within 3.5-6.5.
	if maxD > 10.5 || minD < -0.5 || mean < 3.5 || mean > 6.5 || maxD-minD < 5 {
		t.Fatalf("delays min %.2f mean %.2f max %.2f: not full jitter over [0,10s]", minD, mean, maxD)
	}
	for attempt, want := range map[int]time.Duration{1: 10 * time.Second, 2: 20 * time.Second, 3: 40 * time.Second, 4: time.Minute, 60: time.Minute} {
		if got := cfg.BackoffCeiling(attempt); got != want {
			t.Errorf("BackoffCeiling(%d) = %s, want %s", attempt, got, want)
		}
	}
}

func TestPermanentErrorIsDeadAtOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	enqueue(t, db.Pool, event("P", 1), event("P", 2), event("Q", 1))
	rec := &outboxtest.Recorder{Fail: func(m outbox.Message) error {
		if m.GroupID == "P" {
			return outbox.Permanent(errors.New("InvalidParameter: bad group"))
		}
		return nil
	}}
	d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{MaxAttempts: 10})
	res, err := d.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.Dead != 1 || res.Sent != 1 || res.Claimed != 2 {
		t.Fatalf("batch = %+v, want 2 claimed (heads of P and Q), 1 dead, 1 sent", res)
	}
	if n := count(t, db.Pool, "aggregate_id = 'P' AND state = 'dead' AND attempts = 1 AND last_error LIKE 'permanent: InvalidParameter%'"); n != 1 {
		t.Fatalf("P head not dead with its error after one attempt")
	}
}

// A publisher that returns the wrong number of results or panics fails its
// messages (retryable) without killing the dispatcher.
func TestMisbehavingPublisher(t *testing.T) {
	t.Parallel()
	cases := map[string]outbox.PublisherFunc{
		"short result": func(ctx context.Context, msgs []outbox.Message) []error { return nil },
		"panic":        func(ctx context.Context, msgs []outbox.Message) []error { panic("boom") },
	}
	for name, pub := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			enqueue(t, db.Pool, event("M", 1))
			d := newDispatcher(t, db.Pool, pub, outbox.DispatcherConfig{})
			res, err := d.RunOnce(context.Background())
			if err != nil || res.Retried != 1 {
				t.Fatalf("RunOnce = %+v, %v; want 1 retried", res, err)
			}
			if n := count(t, db.Pool, "state = 'pending' AND claim_token IS NULL AND attempts = 1 AND last_error <> ''"); n != 1 {
				t.Fatal("event not scheduled for retry with its error")
			}
		})
	}
}

// Stopping (context cancelled) mid-batch finishes the claimed batch: nothing
// is left claimed, and no claim starts after the stop.
func TestGracefulStopLeavesNothingClaimed(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	for i := 0; i < 200; i++ {
		enqueue(t, db.Pool, event(fmt.Sprintf("g-%d", i), 1))
	}
	slow := outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
		time.Sleep(100 * time.Millisecond)
		return make([]error, len(msgs))
	})
	d := newDispatcher(t, db.Pool, slow, outbox.DispatcherConfig{BatchSize: 40, PublishConcurrency: 1, PublishBatchSize: 9})
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(150*time.Millisecond, cancel) // like SIGTERM
	if err := d.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, db.Pool, "claim_token IS NOT NULL"); n != 0 {
		t.Fatalf("%d rows left claimed after stop", n)
	}
	sent := count(t, db.Pool, "state = 'sent'")
	if sent == 0 || sent == 200 || sent%40 != 0 {
		t.Fatalf("sent %d: want whole batches of 40, stopped before the end", sent)
	}
}

// With a deadline, Run returns DeadlineMargin early, with the batch in
// progress completed.
func TestRunRespectsDeadlineMargin(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	d := newDispatcher(t, db.Pool, &outboxtest.Recorder{}, outbox.DispatcherConfig{DeadlineMargin: time.Second, PollInterval: 10 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	go func() {
		for i := 0; ctx.Err() == nil; i++ {
			enqueue(t, db.Pool, event("live", i))
			time.Sleep(5 * time.Millisecond)
		}
	}()
	start := time.Now()
	if err := d.Run(ctx); err != nil {
		t.Fatal(err)
	}
	// It must keep working until about deadline minus margin (2s) and return
	// before the deadline itself (3s); the slack absorbs a loaded machine.
	if el := time.Since(start); el >= 3*time.Second || el < 1500*time.Millisecond {
		t.Fatalf("Run returned after %s; want between deadline minus margin (2s) and the deadline (3s)", el)
	}
	if d.Totals().Sent == 0 {
		t.Fatal("nothing published while running")
	}
	if n := count(t, db.Pool, "claim_token IS NOT NULL"); n != 0 {
		t.Fatalf("%d rows left claimed", n)
	}
}

// A claim whose lease expired belongs to whoever re-claimed it: the slow
// dispatcher's late outcome is discarded.
func TestExpiredLeaseOutcomeIsDiscarded(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	enqueue(t, db.Pool, event("L", 1))
	release := make(chan struct{})
	slow := outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
		<-release
		return []error{errors.New("late failure")}
	})
	d1 := newDispatcher(t, db.Pool, slow, outbox.DispatcherConfig{Lease: time.Second, PublishTimeout: 900 * time.Millisecond})
	done := make(chan outbox.BatchResult)
	go func() { r, _ := d1.RunOnce(ctx); done <- r }()
	time.Sleep(1200 * time.Millisecond) // lease expires
	rec := &outboxtest.Recorder{}
	d2 := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{})
	if r, err := d2.RunOnce(ctx); err != nil || r.Sent != 1 {
		t.Fatalf("re-claim after lease: %+v %v", r, err)
	}
	close(release)
	r1 := <-done
	if r1.Lost != 1 {
		t.Fatalf("slow dispatcher result %+v, want Lost 1", r1)
	}
	if n := count(t, db.Pool, "state = 'sent' AND attempts = 2"); n != 1 {
		t.Fatal("late failure overwrote the sent state")
	}
}

func TestPrune(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	for i := 0; i < 25; i++ {
		enqueue(t, db.Pool, event(fmt.Sprintf("p-%d", i), 1))
	}
	// 20 sent long ago, 3 sent recently, 2 pending.
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET state='sent', sent_at = now() - interval '40 days' WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT 20)`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET state='sent', sent_at = now() WHERE state = 'pending' AND id IN (SELECT id FROM outbox WHERE state='pending' ORDER BY id LIMIT 3)`); err != nil {
		t.Fatal(err)
	}
	n, err := outbox.Prune(ctx, db.Pool, 30*24*time.Hour, 7)
	if err != nil || n != 20 {
		t.Fatalf("Prune = %d, %v; want 20", n, err)
	}
	if left := count(t, db.Pool, "true"); left != 5 {
		t.Fatalf("%d rows left, want 5", left)
	}
	if _, err := outbox.Prune(ctx, db.Pool, time.Hour, 0); err == nil {
		t.Fatal("batch 0 accepted")
	}
}

func TestStatsOldestPendingAge(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	st, err := outbox.Stats(ctx, db.Pool)
	if err != nil || st != (outbox.Backlog{}) {
		t.Fatalf("empty stats = %+v, %v", st, err)
	}
	enqueue(t, db.Pool, event("s", 1), event("s", 2))
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET created_at = now() - interval '90 seconds' WHERE aggregate_seq = 1`); err != nil {
		t.Fatal(err)
	}
	st, err = outbox.Stats(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending != 2 || math.Abs(st.OldestPendingAge.Seconds()-90) > 5 {
		t.Fatalf("stats = %+v, want 2 pending, oldest ~90s", st)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	cases := map[string]outbox.DispatcherConfig{
		"batch":          {BatchSize: -1},
		"publish10+":     {PublishBatchSize: 11},
		"cap<base":       {BackoffBase: time.Minute, BackoffCap: time.Second},
		"timeout>=lease": {Lease: 5 * time.Second, PublishTimeout: 5 * time.Second},
	}
	for name, cfg := range cases {
		if _, err := outbox.NewDispatcher(nopDB{}, &outboxtest.Recorder{}, cfg); err == nil {
			t.Errorf("%s: config accepted", name)
		}
	}
}

type nopDB struct{ outbox.DB }

// Drain empties a backlog deeper than one claim per aggregate: with fewer
// aggregates than BatchSize every claim comes back short, yet Drain must
// keep going until nothing is due, in order.
func TestDrainEmptiesDeepAggregates(t *testing.T) {
	t.Parallel()
	for _, workers := range []int{1, 2, 4} {
		t.Run(fmt.Sprintf("workers=%d", workers), func(t *testing.T) {
			db := pgtest.New(t)
			var evs []envelope.Envelope
			for i := 1; i <= 30; i++ {
				for a := 0; a < 7; a++ {
					evs = append(evs, event(fmt.Sprintf("deep-%d", a), i))
				}
			}
			enqueue(t, db.Pool, evs...)
			rec := &outboxtest.Recorder{}
			d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{BatchSize: 500, Workers: workers})
			if err := d.Drain(context.Background()); err != nil {
				t.Fatal(err)
			}
			if rec.Len() != len(evs) || count(t, db.Pool, "state <> 'sent'") != 0 {
				t.Fatalf("one Drain published %d of %d", rec.Len(), len(evs))
			}
			last := map[string]int64{}
			for _, a := range rec.Acks() {
				if a.Sequence != last[a.AggregateID]+1 {
					t.Fatalf("aggregate %s: %d after %d", a.AggregateID, a.Sequence, last[a.AggregateID])
				}
				last[a.AggregateID] = a.Sequence
			}
		})
	}
}

// A claim that reaches the end of its sweep starts over from the beginning.
// If that second claim fails and nothing was claimed, the failure must
// surface: reported as "nothing due", it would end a Drain early and hide a
// broken database.
func TestClaimRestartFailureIsReported(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var evs []envelope.Envelope
	for a := 0; a < 5; a++ {
		evs = append(evs, event(fmt.Sprintf("restart-%d", a), 1))
	}
	enqueue(t, db.Pool, evs...)
	fdb := &failRestartDB{DB: db.Pool}
	d := newDispatcher(t, fdb, &outboxtest.Recorder{}, outbox.DispatcherConfig{BatchSize: 5, Workers: 1})
	if res, err := d.RunOnce(context.Background()); err != nil || res.Claimed != 5 {
		t.Fatalf("first batch: %+v, %v; want 5 claimed", res, err) // a full batch: the next claim starts after it
	}
	fdb.armed.Store(true)
	res, err := d.RunOnce(context.Background())
	if err == nil {
		t.Fatalf("second batch: %+v, nil error; want the failed restart claim's error", res)
	}
	if !errors.Is(err, errRestart) {
		t.Fatalf("second batch error %v; want it to wrap %v", err, errRestart)
	}
}

var errRestart = errors.New("injected: claim from the beginning failed")

// failRestartDB fails, once armed, every claim that starts from the
// beginning of the outbox (cursor 0).
type failRestartDB struct {
	outbox.DB
	armed atomic.Bool
}

func (f *failRestartDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if f.armed.Load() && strings.Contains(sql, "outbox_claim") && len(args) == 4 && args[3] == int64(0) {
		return nil, errRestart
	}
	return f.DB.Query(ctx, sql, args...)
}
