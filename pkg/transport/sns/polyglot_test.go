package sns_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// TestProducersInFourLanguages: Go's Enqueue, SQL's fifobox_enqueue, a Node
// script on node-postgres and a Python script on psycopg write to the same
// aggregates at the same time, each event in a transaction with a business
// row, each also rolling one transaction back. The sequences come out
// gapless, each producer's events in its commit order, nothing of a rolled
// back transaction exists, and every event reaches the consumers through the
// emulator once, in per-aggregate order.
//
// The clients come from examples/producers (scripts/test.sh installs them:
// npm's pg, Debian's python3-psycopg); without them the test skips, unless
// FIFOBOX_REQUIRE_CLIENTS=1 (set by scripts/test.sh) makes that a failure.
func TestProducersInFourLanguages(t *testing.T) {
	t.Parallel()
	node, python := producerClients(t)
	topo := topology.Default()
	env := emulatortest.New(t, topo, 30)
	p := newPipeline(t, env, topo)
	ctx := context.Background()
	if _, err := p.db.Pool.Exec(ctx, `CREATE TABLE poly_business (producer text, aggregate_id text, n int)`); err != nil {
		t.Fatal(err)
	}
	aggs := []string{"poly-0", "poly-1", "poly-2", "poly-3"}
	const perAggregate = 20
	scriptURL := libpqURL(p.db.Schema)
	dir := filepath.Join(emulatortest.RepoRoot(), "examples", "producers")

	var wg sync.WaitGroup
	byProducer := map[string][]produced{}
	var mu sync.Mutex
	record := func(who string, rows []produced, err error) {
		if err != nil {
			t.Errorf("%s producer: %v", who, err)
		}
		mu.Lock()
		byProducer[who] = rows
		mu.Unlock()
	}
	for _, who := range []string{"go", "sql"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rows, err := produceInProcess(ctx, p.db, who, aggs, perAggregate)
			record(who, rows, err)
		}()
	}
	for who, cmd := range map[string][]string{"node": {node, "enqueue.mjs"}, "python": {python, "enqueue.py"}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rows, err := runScript(dir, scriptURL, perAggregate, cmd, aggs)
			record(who, rows, err)
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}

	// Gapless per aggregate; each producer's events in the order it committed them.
	for _, a := range aggs {
		var seqs []int64
		if err := p.db.Pool.QueryRow(ctx, `SELECT array_agg(aggregate_seq ORDER BY aggregate_seq) FROM outbox WHERE aggregate_id = $1`, a).Scan(&seqs); err != nil {
			t.Fatal(err)
		}
		if len(seqs) != 4*perAggregate {
			t.Fatalf("%s: %d events, want %d (4 producers x %d; the rolled-back ones must not exist)", a, len(seqs), 4*perAggregate, perAggregate)
		}
		for i, s := range seqs {
			if s != int64(i+1) {
				t.Fatalf("%s: sequences %v are not 1..%d", a, seqs, len(seqs))
			}
		}
	}
	for who, rows := range byProducer {
		last := map[string]int64{}
		for _, r := range rows {
			if r.Sequence <= last[r.AggregateID] {
				t.Errorf("%s: %s got sequence %d after %d: not its commit order", who, r.AggregateID, r.Sequence, last[r.AggregateID])
			}
			last[r.AggregateID] = r.Sequence
		}
	}
	var business, bad int
	_ = p.db.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE n < 0 OR aggregate_id LIKE 'bad%') FROM poly_business`).Scan(&business, &bad)
	if business != 4*len(aggs)*perAggregate || bad != 0 {
		t.Fatalf("%d business rows (%d from rolled-back or refused transactions), want %d and 0", business, bad, 4*len(aggs)*perAggregate)
	}

	// Bodies from every path decode the same way, and go through the pipeline.
	rows, err := p.db.Pool.Query(ctx, `SELECT body FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	bodies, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	for _, b := range bodies {
		e, err := envelope.Decode(b)
		if err != nil {
			t.Fatalf("stored body does not decode: %v", err)
		}
		for _, c := range topo.Consumers {
			if c.Matches(e.Attributes()) {
				p.expected[c.Name][e.ID] = true
			}
		}
	}
	p.mu.Unlock()
	pub, err := sns.NewPublisher(env.SNS, sns.PublisherConfig{TopicARN: env.TopicARN})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	_, dwg := startDispatcher(t, runCtx, p.db, pub, outbox.DispatcherConfig{BackoffBase: 50 * time.Millisecond, BackoffCap: time.Second})
	rwg := p.startReceivers(runCtx)
	start := time.Now()
	for !p.complete() && time.Since(start) < 2*time.Minute {
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(time.Second) // a duplicate would arrive now
	cancel()
	dwg.Wait()
	rwg.Wait()
	p.check()
}

type produced struct {
	EventID     string `json:"event_id"`
	AggregateID string `json:"aggregate_id"`
	Sequence    int64  `json:"sequence"`
}

// produceInProcess is the Go ("go": outbox.Enqueue) or plain SQL ("sql":
// fifobox_enqueue over pgx) producer, shaped like the scripts.
func produceInProcess(ctx context.Context, db *pgtest.DB, who string, aggs []string, perAggregate int) ([]produced, error) {
	var out []produced
	one := func(agg string, n int, commit bool) (produced, error) {
		var r produced
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			return r, err
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO poly_business (producer, aggregate_id, n) VALUES ($1, $2, $3)`, who, agg, n); err != nil {
			return r, err
		}
		payload := fmt.Sprintf(`{"producer":%q,"n":%d}`, who, n)
		if who == "go" {
			e := envelope.Envelope{ID: uuid.Must(uuid.NewV7()).String(), Type: "order.updated", OccurredAt: time.Now(),
				AggregateType: "order", AggregateID: agg, TenantID: "acme", SchemaVersion: 1, Payload: json.RawMessage(payload)}
			if err := outbox.Enqueue(ctx, tx, e); err != nil {
				return r, err
			}
			if err := tx.QueryRow(ctx, `SELECT event_id::text, aggregate_seq FROM outbox WHERE event_id = $1`, e.ID).Scan(&r.EventID, &r.Sequence); err != nil {
				return r, err
			}
		} else if err := tx.QueryRow(ctx, `SELECT event_id::text, sequence FROM fifobox_enqueue(aggregate_type => 'order',
			aggregate_id => $1, type => 'order.updated', payload => $2, tenant_id => 'acme')`, agg, payload).Scan(&r.EventID, &r.Sequence); err != nil {
			return r, err
		}
		r.AggregateID = agg
		if !commit {
			return r, tx.Rollback(ctx)
		}
		return r, tx.Commit(ctx)
	}
	for n := 0; n < perAggregate; n++ {
		for _, a := range aggs {
			r, err := one(a, n, true)
			if err != nil {
				return out, err
			}
			out = append(out, r)
		}
	}
	for _, a := range aggs {
		if _, err := one(a, -1, false); err != nil {
			return out, err
		}
	}
	return out, nil
}

func runScript(dir, dbURL string, perAggregate int, cmdline, aggs []string) ([]produced, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, cmdline[0], append(cmdline[1:], aggs...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL, fmt.Sprintf("FIFOBOX_EVENTS=%d", perAggregate))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s: %v: %s", strings.Join(cmdline, " "), err, stderr.String())
	}
	var rows []produced
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		var r produced
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return rows, fmt.Errorf("%s printed %q: %v", cmdline[1], sc.Text(), err)
		}
		rows = append(rows, r)
	}
	return rows, nil
}

// libpqURL connects to schema through libpq-style options, which
// node-postgres and psycopg both read.
func libpqURL(schema string) string {
	base := pgtest.URL()
	sep := "?"
	if strings.Contains(base, "?") {
		sep = "&"
	}
	return base + sep + "options=" + strings.ReplaceAll(url.QueryEscape("-c search_path="+schema), "+", "%20")
}

// producerClients finds Node with examples/producers' node-postgres and a
// Python with psycopg.
func producerClients(t *testing.T) (node, python string) {
	t.Helper()
	root := emulatortest.RepoRoot()
	skip := func(why string) {
		if os.Getenv("FIFOBOX_REQUIRE_CLIENTS") == "1" {
			t.Fatalf("%s (scripts/test.sh installs it)", why)
		}
		t.Skipf("%s; run scripts/test.sh or see examples/producers", why)
	}
	if _, err := os.Stat(filepath.Join(root, "examples", "producers", "node_modules", "pg")); err != nil {
		skip("node-postgres is not installed in examples/producers")
	}
	for _, n := range []string{filepath.Join(root, "localstack", "node_modules", ".bin", "node"), "node"} {
		if p, err := exec.LookPath(n); err == nil {
			node = p
			break
		}
	}
	if node == "" {
		skip("no node")
	}
	for _, py := range []string{"python3", "/usr/bin/python3"} {
		if exec.Command(py, "-c", "import psycopg").Run() == nil {
			python = py
			break
		}
	}
	if python == "" {
		skip("no python3 with psycopg")
	}
	return node, python
}
