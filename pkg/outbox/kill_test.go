package outbox_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

const killURLEnv = "FIFOBOX_KILL_CHILD_URL"

// A dispatcher process killed in the middle of publishing a batch leaves
// its runs leased; with the default configuration another dispatcher
// publishes them again in under 10 s (the lease, renewed while the batch was
// alive, runs out Lease after the last renewal), in order, and the only
// duplicates are events whose publish outcome the killed process never
// recorded. The kill lands just after a renewal: the longest wait there is.
func TestKilledDispatcherRunsAreClaimedAgainQuickly(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("kill test spawns a process")
	}
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE kill_acks (n bigserial PRIMARY KEY, event_id uuid, aggregate_id text, seq bigint)`); err != nil {
		t.Fatal(err)
	}
	const aggregates, perAggregate = 20, 5
	want := map[string]int{}
	var evs []envelope.Envelope
	for i := 1; i <= perAggregate; i++ {
		for a := 0; a < aggregates; a++ {
			agg := fmt.Sprintf("k-%02d", a)
			want[agg]++
			evs = append(evs, event(agg, i))
		}
	}
	enqueue(t, db.Pool, evs...)

	cmd := exec.Command(os.Args[0], "-test.run=^TestKillChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), killURLEnv+"="+db.URL)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	defer func() {
		if !killed {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	// Wait for the child's batch to be mid-publish (its first call
	// acknowledged, the next one hanging) and for a renewal of its lease.
	var first time.Time
	leaseEnd := func() time.Time {
		var end *time.Time
		if err := db.Pool.QueryRow(ctx, `SELECT max(coalesce(lease_until, due_at)) FROM outbox_heads WHERE claim_token IS NOT NULL`).Scan(&end); err != nil {
			t.Fatal(err)
		}
		if end == nil {
			return time.Time{}
		}
		return *end
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if time.Now().After(deadline) {
			t.Fatal("the child never acknowledged a call and renewed its lease")
		}
		time.Sleep(10 * time.Millisecond)
		var acks int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kill_acks`).Scan(&acks); err != nil {
			t.Fatal(err)
		}
		end := leaseEnd()
		if acks == 0 || end.IsZero() {
			continue
		}
		if first.IsZero() {
			first = end
			continue
		}
		if end.After(first) {
			break // renewed
		}
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	killed = true
	killedAt := time.Now()
	stranded := headCount(t, db.Pool, "claim_token IS NOT NULL")
	if stranded == 0 {
		t.Fatal("no run was claimed when the child was killed")
	}

	// Another dispatcher, default configuration, takes over.
	var (
		mu         sync.Mutex
		firstAgain = map[string]time.Duration{}
	)
	rec := &outboxtest.Recorder{}
	pub := outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
		mu.Lock()
		for _, m := range msgs {
			if _, ok := firstAgain[m.GroupID]; !ok {
				firstAgain[m.GroupID] = time.Since(killedAt)
			}
		}
		mu.Unlock()
		return rec.Publish(ctx, msgs)
	})
	d := newDispatcher(t, db.Pool, pub, outbox.DispatcherConfig{})
	if lease := d.Config().Lease; lease >= 10*time.Second {
		t.Fatalf("default Lease %s: a killed dispatcher's runs would wait that long", lease)
	}
	runCtx, stop := context.WithCancel(ctx)
	var running sync.WaitGroup
	running.Add(1)
	go func() { defer running.Done(); _ = d.Run(runCtx) }()
	var done atomic.Bool
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if count(t, db.Pool, "state <> 'sent'") == 0 {
			done.Store(true)
			break
		}
	}
	allSent := time.Since(killedAt)
	stop()
	running.Wait()
	if !done.Load() {
		t.Fatalf("%d events not sent 30 s after the kill", count(t, db.Pool, "state <> 'sent'"))
	}

	// Order over both processes: the child's acknowledgements, then the
	// new dispatcher's.
	rows, err := db.Pool.Query(ctx, `SELECT event_id::text, aggregate_id, seq FROM kill_acks ORDER BY n`)
	if err != nil {
		t.Fatal(err)
	}
	var acks []outboxtest.Ack
	childAcked := map[string]bool{}
	for rows.Next() {
		var a outboxtest.Ack
		if err := rows.Scan(&a.EventID, &a.AggregateID, &a.Sequence); err != nil {
			t.Fatal(err)
		}
		acks = append(acks, a)
		childAcked[a.EventID] = true
	}
	rows.Close()
	childN := len(acks)
	again := rec.Acks()
	acks = append(acks, again...)
	dups := checkOrder(t, acks, want, true)
	seen := map[string]bool{}
	republished := 0
	for _, a := range again {
		if seen[a.EventID] {
			t.Fatalf("event %s published twice by the new dispatcher", a.EventID)
		}
		seen[a.EventID] = true
		if childAcked[a.EventID] {
			republished++
		}
	}
	if dups != republished {
		t.Fatalf("%d duplicates, of which %d events the killed child acknowledged: only those may go out twice", dups, republished)
	}
	var wait time.Duration
	mu.Lock()
	for _, w := range firstAgain {
		wait = max(wait, w)
	}
	mu.Unlock()
	t.Logf("child acknowledged %d events, killed just after renewing the lease of %d runs; another dispatcher published their aggregates again after at most %s (all sent after %s); %d duplicates (events acknowledged by the child, never recorded)",
		childN, stranded, wait.Round(time.Millisecond), allSent.Round(time.Millisecond), dups)
	if wait >= 10*time.Second {
		t.Fatalf("a killed dispatcher's aggregates waited %s; want under 10 s", wait)
	}
}

// TestKillChild is the dispatcher process TestKilledDispatcherRunsAreClaimedAgainQuickly
// starts and kills: default configuration; its first Publish call is
// acknowledged (recorded in kill_acks), every later one hangs.
func TestKillChild(t *testing.T) {
	url := os.Getenv(killURLEnv)
	if url == "" {
		t.Skip("helper process for TestKilledDispatcherRunsAreClaimedAgainQuickly")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	pub := outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
		if calls.Add(1) > 1 {
			select {} // a broker that never answers, until the kill
		}
		ids := make([]string, len(msgs))
		aggs := make([]string, len(msgs))
		seqs := make([]int64, len(msgs))
		for i, m := range msgs {
			ids[i], aggs[i], seqs[i] = m.EventID, m.GroupID, m.Sequence
		}
		errs := make([]error, len(msgs))
		if _, err := pool.Exec(ctx, `INSERT INTO kill_acks (event_id, aggregate_id, seq) SELECT * FROM unnest($1::uuid[], $2::text[], $3::bigint[])`, ids, aggs, seqs); err != nil {
			for i := range errs {
				errs[i] = err
			}
		}
		return errs
	})
	d, err := outbox.NewDispatcher(pool, pub, outbox.DispatcherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	_ = d.Run(ctx)
}
