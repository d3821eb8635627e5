package outbox_test

import (
	"context"
	"fmt"
	mathrand "math/rand"
	"math/rand/v2"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

const crashURLEnv = "FIFOBOX_CRASH_CHILD_URL"

// TestCrashRecovery kills a dispatcher process with SIGKILL in the middle of
// batches, restarts it, and repeats. The "broker" is a table the child writes
// its acknowledgements to, committed before the child marks the rows sent, so
// a kill between publish and mark shows up as duplicates (the claimed run is
// published again). Nothing may be lost and per-aggregate order must hold:
// an event is never acknowledged before every earlier one of its aggregate.
// The backlog is interleaved over 60 aggregates, or skewed: one aggregate
// with half of it, or a Zipf (s = 1.1) spread over 300 aggregates.
func TestCrashRecovery(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("crash test spawns processes")
	}
	zipf := mathrand.NewZipf(mathrand.New(mathrand.NewSource(7)), 1.1, 1, 299)
	for _, sh := range []struct {
		name  string
		total int
		pick  func(i int) string
	}{
		{"interleaved", 4800, func(i int) string { return fmt.Sprintf("c-%02d", i%60) }},
		{"hot-half", 4000, func(i int) string {
			if i%2 == 0 {
				return "hot"
			}
			return fmt.Sprintf("c-%02d", i%40)
		}},
		{"zipf", 4000, func(int) string { return fmt.Sprintf("z-%03d", zipf.Uint64()) }},
	} {
		// Built here, not in the parallel subtest: zipf is not safe for
		// concurrent use.
		want := map[string]int{}
		var batches [][]envelope.Envelope
		var evs []envelope.Envelope
		for i := 0; i < sh.total; i++ {
			agg := sh.pick(i)
			want[agg]++
			evs = append(evs, event(agg, want[agg]))
			if len(evs) == 60 {
				batches, evs = append(batches, evs), nil
			}
		}
		batches = append(batches, evs)
		t.Run(sh.name, func(t *testing.T) {
			t.Parallel()
			crashRecovery(t, batches, want)
		})
	}
}

func crashRecovery(t *testing.T, batches [][]envelope.Envelope, want map[string]int) {
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE crash_acks (n bigserial PRIMARY KEY, event_id uuid, aggregate_id text, seq bigint)`); err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, evs := range batches {
		enqueue(t, db.Pool, evs...)
		total += len(evs)
	}

	start := func() *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
		cmd.Env = append(os.Environ(), crashURLEnv+"="+db.URL)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return cmd
	}
	kills := 0
	for i := 0; i < 10; i++ {
		cmd := start()
		time.Sleep(time.Duration(300+rand.IntN(500)) * time.Millisecond)
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = cmd.Wait()
		kills++
	}
	// A last child runs until everything is sent.
	cmd := start()
	deadline := time.Now().Add(90 * time.Second)
	for count(t, db.Pool, "state <> 'sent'") > 0 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	_ = cmd.Wait()

	rows, err := db.Pool.Query(ctx, `SELECT event_id::text, aggregate_id, seq FROM crash_acks ORDER BY n`)
	if err != nil {
		t.Fatal(err)
	}
	var acks []outboxtest.Ack
	for rows.Next() {
		var a outboxtest.Ack
		if err := rows.Scan(&a.EventID, &a.AggregateID, &a.Sequence); err != nil {
			t.Fatal(err)
		}
		acks = append(acks, a)
	}
	rows.Close()
	dups := checkOrder(t, acks, want, true)
	var reclaimed int
	_ = db.Pool.QueryRow(ctx, `SELECT coalesce(sum(expired_leases), 0) FROM outbox_heads`).Scan(&reclaimed)
	t.Logf("%d kills; %d events of %d aggregates, %d acknowledgements, %d duplicates from kills between publish and mark, %d runs re-claimed after a lease expired",
		kills, total, len(want), len(acks), dups, reclaimed)
	if n := count(t, db.Pool, "state <> 'sent'"); n != 0 {
		t.Fatalf("%d events not sent", n)
	}
	if reclaimed == 0 {
		t.Fatal("no kill landed inside a batch: the test did not exercise a crash")
	}
}

// TestCrashChild is the dispatcher process TestCrashRecovery starts and kills.
func TestCrashChild(t *testing.T) {
	url := os.Getenv(crashURLEnv)
	if url == "" {
		t.Skip("helper process for TestCrashRecovery")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	pub := outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
		ids := make([]string, len(msgs))
		aggs := make([]string, len(msgs))
		seqs := make([]int64, len(msgs))
		for i, m := range msgs {
			ids[i], aggs[i], seqs[i] = m.EventID, m.GroupID, m.Sequence
		}
		errs := make([]error, len(msgs))
		if _, err := pool.Exec(ctx, `INSERT INTO crash_acks (event_id, aggregate_id, seq) SELECT * FROM unnest($1::uuid[], $2::text[], $3::bigint[])`, ids, aggs, seqs); err != nil {
			for i := range errs {
				errs[i] = err
			}
		}
		time.Sleep(10 * time.Millisecond) // a broker round trip; widens the publish-to-mark window
		return errs
	})
	d, err := outbox.NewDispatcher(pool, pub, outbox.DispatcherConfig{
		BatchSize: 30, Lease: 2 * time.Second, PublishTimeout: 500 * time.Millisecond, MarkTimeout: 400 * time.Millisecond,
		DeadlineMargin: time.Second, PollInterval: 10 * time.Millisecond, PublishConcurrency: 2,
	})
	if err != nil {
		t.Fatal(err)
	}
	_ = d.Run(ctx)
}
