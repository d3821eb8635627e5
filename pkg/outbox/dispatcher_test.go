package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	mathrand "math/rand"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

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

// Torture: 4 dispatchers, 20,000 events enqueued while they run, a publisher
// failing 20% of calls and 5% of single entries: everything is acknowledged
// exactly once and per-aggregate order holds. The shapes spread the events
// over 500 aggregates uniformly, by Zipf (s = 1.1), and with one aggregate
// taking half of them. Half the producers write in REPEATABLE READ
// transactions (producers only insert wake-ups, so their isolation level
// must not matter; see migrations/00009).
func TestTortureConcurrentDispatchersWithFailures(t *testing.T) {
	t.Parallel()
	const aggregates = 500
	zipf := func() func() int {
		var mu sync.Mutex
		z := mathrand.NewZipf(mathrand.New(mathrand.NewSource(rand.Int64())), 1.1, 1, aggregates-1)
		return func() int { mu.Lock(); defer mu.Unlock(); return int(z.Uint64()) }
	}
	// A single aggregate's events go out one after another, and a quarter
	// of publish calls fail here: the skewed shapes are smaller so that
	// their hottest aggregate drains within the deadline on a loaded CI
	// machine.
	shapes := []struct {
		name  string
		total int
		pick  func() func() int
	}{
		{"uniform", 20000, func() func() int { return func() int { return rand.IntN(aggregates) } }},
		{"zipf", 12000, zipf},
		{"hot-half", 8000, func() func() int {
			return func() int {
				if rand.IntN(2) == 0 {
					return 0
				}
				return 1 + rand.IntN(aggregates-1)
			}
		}},
	}
	for _, sh := range shapes {
		t.Run(sh.name, func(t *testing.T) {
			t.Parallel()
			torture(t, sh.total, sh.pick())
		})
	}
}

func torture(t *testing.T, total int, pick func() int) {
	const dispatchers = 4
	db := pgtest.New(t)
	rec := &outboxtest.Recorder{FailRate: 0.2, EntryFailRate: 0.05}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for i := 0; i < dispatchers; i++ {
		d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{
			BatchSize: 100, BackoffBase: time.Millisecond, BackoffCap: 20 * time.Millisecond,
			PollInterval: 5 * time.Millisecond, PublishConcurrency: 4,
		})
		wg.Add(1)
		go func() { defer wg.Done(); _ = d.Run(ctx) }()
	}

	// Producers: transactions of 1-10 events over the shape's aggregates.
	want := map[string]int{}
	var mu sync.Mutex
	var pwg sync.WaitGroup
	var produced, serialization atomic.Int64
	for p := 0; p < 4; p++ {
		iso := pgx.ReadCommitted
		if p%2 == 1 {
			iso = pgx.RepeatableRead
		}
		pwg.Add(1)
		go func() {
			defer pwg.Done()
			for produced.Load() < int64(total) {
				n := 1 + rand.IntN(10)
				if left := int64(total) - produced.Add(int64(n)) + int64(n); left < int64(n) {
					n = int(max(left, 0))
				}
				if n == 0 {
					return
				}
				evs := make([]envelope.Envelope, n)
				for i := range evs {
					evs[i] = event(fmt.Sprintf("agg-%03d", pick()), i)
				}
				for {
					err := pgx.BeginTxFunc(ctx, db.Pool, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) error {
						return outbox.Enqueue(ctx, tx, evs...)
					})
					// Two writers of one aggregate in REPEATABLE READ: the
					// later one gets a serialization failure, as for any row
					// both update; nothing of it was written: retry.
					var pgErr *pgconn.PgError
					if errors.As(err, &pgErr) && pgErr.Code == "40001" {
						serialization.Add(1)
						continue
					}
					if err != nil {
						t.Errorf("enqueue: %v", err)
						return
					}
					break
				}
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

	deadline := time.Now().Add(4 * time.Minute)
	for rec.Len() < total && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	// Every head must come to rest: an empty head left ready, or a claimed
	// one, would mean the wake-up protocol lost track of an aggregate.
	for headCount(t, db.Pool, "state <> 'idle'") > 0 && time.Now().Before(deadline) {
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
	if n := count(t, db.Pool, "state <> 'sent'"); n != 0 {
		t.Fatalf("%d events not sent", n)
	}
	if n := headCount(t, db.Pool, "state <> 'idle' OR claim_token IS NOT NULL"); n != 0 {
		t.Fatalf("%d heads not idle after the drain", n)
	}
	var retried int
	_ = db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox WHERE attempts > 1").Scan(&retried)
	t.Logf("%d aggregates; failing publisher: %d of %d events needed retries; %d producer transactions retried after a serialization failure",
		len(want), retried, total, serialization.Load())
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
		// B's whole run goes out in the first round; A's head fails each time.
		if _, err := d.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
		var state, lastErr string
		var attempts int
		var delay float64
		err := db.Pool.QueryRow(ctx, `SELECT o.state, o.attempts, coalesce(o.last_error,''), extract(epoch FROM h.due_at - now())
			FROM outbox o JOIN outbox_heads h USING (aggregate_type, aggregate_id)
			WHERE o.aggregate_id = 'A' AND o.aggregate_seq = 1`).Scan(&state, &attempts, &lastErr, &delay)
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
			if _, err := db.Pool.Exec(ctx, `UPDATE outbox_heads SET due_at = now() WHERE aggregate_id = 'A'`); err != nil {
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
	if st.Dead != 1 || st.ParkedAggregates != 1 || st.Pending != 2 || st.ParkedEvents != 3 || st.DueEvents != 0 {
		t.Fatalf("stats = %+v, want dead 1, parked 1 (3 events), pending 2, none due", st)
	}
	// Once the dead event is re-queued and the broker recovers, A continues in order.
	failA.Store(false)
	if n, err := outbox.RequeueDead(ctx, db.Pool, outbox.DeadSelection{AggregateType: "order"}); err != nil || n != 1 {
		t.Fatalf("RequeueDead = %d, %v; want 1", n, err)
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
		SELECT extract(epoch FROM due_at - now()) AS s FROM outbox_heads) x`).Scan(&mean, &minD, &maxD)
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
			return envelope.Permanent(errors.New("InvalidParameter: bad group"))
		}
		return nil
	}}
	d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{MaxAttempts: 10})
	res, err := d.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.Dead != 1 || res.Sent != 1 || res.Claimed != 3 || res.Released != 1 {
		t.Fatalf("batch = %+v, want 3 claimed (P's run of 2, Q's of 1), 1 dead, 1 sent, 1 released behind the dead one", res)
	}
	if n := count(t, db.Pool, "aggregate_id = 'P' AND aggregate_seq = 2 AND state = 'pending' AND attempts = 0"); n != 1 {
		t.Fatal("P's second event was attempted or changed behind its dead head")
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
			if n := count(t, db.Pool, "state = 'pending' AND attempts = 1 AND last_error <> ''"); n != 1 {
				t.Fatal("event not scheduled for retry with its error")
			}
			// Full jitter may draw a delay of a few milliseconds, already past
			// when a loaded machine gets here: check the head's due time
			// against the mark's time (retry_since) and the first attempt's ceiling
			// (the default BackoffBase, 1 s).
			if n := headCount(t, db.Pool, "claim_token IS NULL AND retry_since IS NOT NULL AND due_at >= retry_since AND due_at <= retry_since + interval '1 s'"); n != 1 {
				t.Fatal("head not backing off")
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
	d := newDispatcher(t, db.Pool, slow, outbox.DispatcherConfig{BatchSize: 40, PublishConcurrency: 1, PublishBatchSize: 9, Workers: 1})
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(150*time.Millisecond, cancel) // like SIGTERM
	if err := d.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if n := headCount(t, db.Pool, "claim_token IS NOT NULL"); n != 0 {
		t.Fatalf("%d aggregates left claimed after stop", n)
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
	d := newDispatcher(t, db.Pool, &outboxtest.Recorder{}, outbox.DispatcherConfig{DeadlineMargin: time.Second, MarkTimeout: 500 * time.Millisecond, PollInterval: 10 * time.Millisecond})
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
	if n := headCount(t, db.Pool, "claim_token IS NOT NULL"); n != 0 {
		t.Fatalf("%d aggregates left claimed", n)
	}
}

// A claim whose lease expired belongs to whoever re-claimed it: a slow
// dispatcher's late outcome (its database writes, lease renewals included,
// held up past the lease) is discarded, and the re-claim's stands.
func TestExpiredLeaseOutcomeIsDiscarded(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	enqueue(t, db.Pool, event("L", 1))
	release := make(chan struct{})
	slow := &slowMarkDB{DB: db.Pool, release: release}
	d1 := newDispatcher(t, slow, &outboxtest.Recorder{EntryFailRate: 1}, outbox.DispatcherConfig{Lease: 2 * time.Second, PublishTimeout: 900 * time.Millisecond, MarkTimeout: 500 * time.Millisecond})
	done := make(chan outbox.BatchResult)
	go func() { r, _ := d1.RunOnce(ctx); done <- r }()
	time.Sleep(2200 * time.Millisecond) // lease expires while d1's outcome (a failure) waits
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
	if n := count(t, db.Pool, "state = 'sent' AND attempts = 1 AND last_error IS NULL"); n != 1 {
		t.Fatal("the late failure was recorded over the re-claim's outcome")
	}
	if n := headCount(t, db.Pool, "expired_leases = 1 AND claim_token IS NULL"); n != 1 {
		t.Fatal("the re-claim did not count the expired lease")
	}
}

// slowMarkDB holds every outcome write and lease renewal until release is
// closed.
type slowMarkDB struct {
	outbox.DB
	release chan struct{}
}

func (s *slowMarkDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if strings.Contains(sql, "outbox_mark_runs") || strings.Contains(sql, "outbox_extend_lease") {
		<-s.release
	}
	return s.DB.QueryRow(context.WithoutCancel(ctx), sql, args...)
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
	st.OldestTransactionAge = 0 // other tests' sessions share the server
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
		"lease<=mark+1s": {Lease: 3 * time.Second, MarkTimeout: 2 * time.Second},
		"lease<1s":       {Lease: 500 * time.Millisecond, MarkTimeout: 100 * time.Millisecond},
		"margin<=mark":   {DeadlineMargin: time.Second, MarkTimeout: time.Second},
		"run>batch":      {BatchSize: 10, MaxRun: 11},
		"retryFor<cap":   {BackoffCap: time.Hour, RetryFor: time.Minute},
		"attempts<0":     {MaxAttempts: -1},
	}
	for name, cfg := range cases {
		if _, err := outbox.NewDispatcher(nopDB{}, &outboxtest.Recorder{}, cfg); err == nil {
			t.Errorf("%s: config accepted", name)
		}
	}
	// The lease is renewed while a batch publishes: a Publish call may
	// take longer than the lease.
	if _, err := outbox.NewDispatcher(nopDB{}, &outboxtest.Recorder{}, outbox.DispatcherConfig{Lease: 5 * time.Second, PublishTimeout: time.Minute}); err != nil {
		t.Errorf("PublishTimeout beyond the lease refused: %v", err)
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
