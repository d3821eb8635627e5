package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
)

var quietLog = slog.New(slog.NewTextHandler(io.Discard, nil))

// fakeBroker records the engine's settle calls, as a transport would carry
// them out, and can refuse them.
type fakeBroker struct {
	mu      sync.Mutex
	calls   []call
	refuse  func(c call) error
	kept    atomic.Int64
	keepGap time.Duration
}

type call struct {
	kind  string // ack, retry, dead
	id    string
	retry inbox.Retry
	dead  inbox.DeadLetter
}

func (f *fakeBroker) add(c call) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.refuse != nil {
		if err := f.refuse(c); err != nil {
			return err
		}
	}
	f.calls = append(f.calls, c)
	return nil
}

func (f *fakeBroker) Ack(_ context.Context, r *inbox.Record) error {
	return f.add(call{kind: "ack", id: r.ID})
}

func (f *fakeBroker) Retry(_ context.Context, r *inbox.Record, rt inbox.Retry) error {
	return f.add(call{kind: "retry", id: r.ID, retry: rt})
}

func (f *fakeBroker) DeadLetter(_ context.Context, r *inbox.Record, dl inbox.DeadLetter) error {
	return f.add(call{kind: "dead", id: r.ID, dead: dl})
}

func (f *fakeBroker) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.calls)
}

func (f *fakeBroker) taken() []call {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := f.calls
	f.calls = nil
	return out
}

// keepingBroker is a fakeBroker that also keeps work alive (a Keeper).
type keepingBroker struct{ *fakeBroker }

func (k keepingBroker) KeepAlive(_ context.Context, rs []*inbox.Record) { k.kept.Add(int64(len(rs))) }
func (k keepingBroker) KeepAliveEvery() time.Duration                   { return k.keepGap }

// recordOf is e as a delivered record with id.
func recordOf(t testing.TB, id string, e envelope.Envelope) *inbox.Record {
	t.Helper()
	body, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return &inbox.Record{ID: id, Body: body}
}

// effectsInOrder lists aggregate/sequence of the applied effects, in order.
func effectsInOrder(t testing.TB, db *pgtest.DB) []string {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), "SELECT aggregate_id || '/' || sequence FROM effects ORDER BY n")
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func summary(cs []call) string {
	var parts []string
	for _, c := range cs {
		s := c.kind + " " + c.id
		switch c.kind {
		case "retry":
			s += fmt.Sprintf(" n=%d failures=%d", c.retry.N, c.retry.Failures)
			if c.retry.Behind != "" {
				s += " behind"
			}
		case "dead":
			s += " " + c.dead.Class
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, "; ")
}

func newEngine(t testing.TB, db inbox.DB, apply inbox.Apply, cfg inbox.EngineConfig) *inbox.Engine {
	t.Helper()
	if cfg.Consumer == "" {
		cfg.Consumer = "c"
	}
	if cfg.Logger == nil {
		cfg.Logger = quietLog
	}
	if cfg.RetryDelay == nil {
		cfg.RetryDelay = func(n int) time.Duration { return time.Duration(n) * time.Second }
	}
	e, err := inbox.NewEngine(db, apply, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// failing is a side effect that fails the events in fail (by id) with the
// error given, and records the rest.
type failing struct {
	mu   sync.Mutex
	fail map[string]error
}

func (f *failing) set(id string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail == nil {
		f.fail = map[string]error{}
	}
	if err == nil {
		delete(f.fail, id)
		return
	}
	f.fail[id] = err
}

func (f *failing) apply(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
	f.mu.Lock()
	err := f.fail[e.ID]
	f.mu.Unlock()
	if err != nil {
		return err
	}
	return record(ctx, tx, e)
}

func parkedRows(t testing.TB, db *pgtest.DB) map[string]int {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), "SELECT group_id, failures FROM inbox_parked")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for rows.Next() {
		var g string
		var n int
		if err := rows.Scan(&g, &n); err != nil {
			t.Fatal(err)
		}
		out[g] = n
	}
	return out
}

func heldRowsOf(t testing.TB, db *pgtest.DB) []string {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), "SELECT group_id || ':' || class FROM inbox_held ORDER BY position")
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// The engine applies a batch's groups on their lanes, each group in order,
// and settles every record through the broker after the commit: applied
// and duplicate records are acknowledged.
func TestEngineAppliesInOrderAndAcksDuplicates(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	fb := &fakeBroker{}
	e := newEngine(t, db.Pool, record, inbox.EngineConfig{Lanes: 3})
	var recs []*inbox.Record
	for s := int64(1); s <= 5; s++ {
		for _, g := range []string{"A", "B", "C", "D"} {
			recs = append(recs, recordOf(t, fmt.Sprintf("%s%d", g, s), ev(g, s)))
		}
	}
	recs = append(recs, &inbox.Record{ID: "A1-again", Body: recs[0].Body})
	if err := e.Handle(context.Background(), fb, recs); err != nil {
		t.Fatal(err)
	}
	calls := fb.taken()
	if len(calls) != len(recs) {
		t.Fatalf("%d settle calls for %d records: %s", len(calls), len(recs), summary(calls))
	}
	for _, c := range calls {
		if c.kind != "ack" {
			t.Errorf("%s settled %s, want ack", c.id, c.kind)
		}
	}
	last := map[string]int64{}
	for _, s := range effectsInOrder(t, db) {
		var g string
		var n int64
		_, _ = fmt.Sscanf(strings.Replace(s, "/", " ", 1), "%s %d", &g, &n)
		if n != last[g]+1 {
			t.Fatalf("applied %s after %s/%d", s, g, last[g])
		}
		last[g] = n
	}
	if len(effectsInOrder(t, db)) != 20 {
		t.Fatalf("%d effects, want 20 (the copy is a duplicate)", len(effectsInOrder(t, db)))
	}
}

// A transient failure parks the group in the database: the event is
// retried with its failure count, the group's later events wait behind it
// (even in a new engine, as after a restart), failures are counted per
// event whatever the message says, and the event is dead-lettered after
// its last retry, holding the group in strict order until its redrive.
func TestEngineParksRetriesAndHoldsDurably(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	fb := &fakeBroker{}
	f := &failing{}
	cfg := inbox.EngineConfig{MaxRetries: 2, Lanes: 1}
	ctx := context.Background()
	a1, a2, a3, b1 := ev("A", 1), ev("A", 2), ev("A", 3), ev("B", 1)
	f.set(a1.ID, errors.New("downstream busy"))

	e := newEngine(t, db.Pool, f.apply, cfg)
	if err := e.Handle(ctx, fb, []*inbox.Record{recordOf(t, "a1", a1), recordOf(t, "a2", a2), recordOf(t, "b1", b1)}); err != nil {
		t.Fatal(err)
	}
	if got, want := summary(fb.taken()), "retry a1 n=1 failures=1; retry a2 n=1 failures=0 behind; ack b1"; got != want {
		t.Fatalf("first delivery: %s, want %s", got, want)
	}
	if p := parkedRows(t, db); p["A"] != 1 || len(p) != 1 {
		t.Fatalf("parked %v, want A with 1 failure", p)
	}
	// A restart: a new engine. a3 arrives before a1 is back; it waits too.
	// a1 comes back with a message that forgot its failures (Failures 0):
	// the park's count holds.
	e = newEngine(t, db.Pool, f.apply, cfg)
	if err := e.Handle(ctx, fb, []*inbox.Record{recordOf(t, "a3", a3), recordOf(t, "a1", a1)}); err != nil {
		t.Fatal(err)
	}
	if got, want := summary(fb.taken()), "retry a3 n=1 failures=0 behind; retry a1 n=2 failures=2"; got != want {
		t.Fatalf("after the restart: %s, want %s", got, want)
	}
	// Its last retry fails too: dead-lettered, the group held, its
	// followers held behind it (strict order).
	if err := e.Handle(ctx, fb, []*inbox.Record{recordOf(t, "a1", a1), recordOf(t, "a2", a2), recordOf(t, "a3", a3)}); err != nil {
		t.Fatal(err)
	}
	if got, want := summary(fb.taken()), "dead a1 exhausted; dead a2 held; dead a3 held"; got != want {
		t.Fatalf("last retry: %s, want %s", got, want)
	}
	if p := parkedRows(t, db); len(p) != 0 {
		t.Fatalf("parks left after the dead-letter: %v", p)
	}
	if h := heldRowsOf(t, db); strings.Join(h, ",") != "A:exhausted,A:held,A:held" {
		t.Fatalf("held rows %v", h)
	}
	// A new event of the held group goes behind too.
	a4 := ev("A", 4)
	if err := e.Handle(ctx, fb, []*inbox.Record{recordOf(t, "a4", a4)}); err != nil {
		t.Fatal(err)
	}
	if got := summary(fb.taken()); got != "dead a4 held" {
		t.Fatalf("new event of a held group: %s", got)
	}
	// Fixed and redriven in DLQ order: applied 1, 2, 3, 4.
	f.set(a1.ID, nil)
	if err := e.Handle(ctx, fb, []*inbox.Record{recordOf(t, "a1", a1), recordOf(t, "a2", a2), recordOf(t, "a3", a3), recordOf(t, "a4", a4)}); err != nil {
		t.Fatal(err)
	}
	if got, want := summary(fb.taken()), "ack a1; ack a2; ack a3; ack a4"; got != want {
		t.Fatalf("redrive: %s, want %s", got, want)
	}
	if got := strings.Join(effectsInOrder(t, db), ","); got != "B/1,A/1,A/2,A/3,A/4" {
		t.Fatalf("effects %s", got)
	}
	if h := heldRowsOf(t, db); len(h) != 0 {
		t.Fatalf("held rows left: %v", h)
	}
}

// Invalid bodies and permanent failures go to the dead-letter queue at
// once; relaxed order lets the group go on past them.
func TestEngineDeadLettersAtOnceAndRelaxedOrderGoesOn(t *testing.T) {
	t.Parallel()
	for _, order := range []inbox.Order{inbox.OrderStrict, inbox.OrderRelaxed} {
		t.Run(order.String(), func(t *testing.T) {
			t.Parallel()
			db := newDB(t)
			fb := &fakeBroker{}
			f := &failing{}
			a1, a2 := ev("A", 1), ev("A", 2)
			f.set(a1.ID, envelope.Permanent(errors.New("unknown schema")))
			e := newEngine(t, db.Pool, f.apply, inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{Order: order}, MaxRetries: 5, Lanes: 1})
			recs := []*inbox.Record{recordOf(t, "a1", a1), recordOf(t, "a2", a2), {ID: "junk", Body: []byte("not json")},
				{ID: "junk-of-B", Group: "B", Body: []byte("{}")}}
			if err := e.Handle(context.Background(), fb, recs); err != nil {
				t.Fatal(err)
			}
			got := summary(fb.taken())
			want := "dead a1 permanent; dead a2 held; dead junk invalid; dead junk-of-B invalid"
			held := "A:permanent,A:held,B:invalid"
			if order == inbox.OrderRelaxed {
				want, held = "dead a1 permanent; ack a2; dead junk invalid; dead junk-of-B invalid", ""
			}
			// Lanes settle concurrently: compare per record.
			for _, w := range strings.Split(want, "; ") {
				if !strings.Contains("; "+got+"; ", "; "+w+"; ") {
					t.Errorf("settled %s, want %s among them", got, w)
				}
			}
			if h := strings.Join(heldRowsOf(t, db), ","); h != held {
				t.Errorf("held rows %s, want %s", h, held)
			}
		})
	}
}

// flakyDB is the inbox database with an outage switch: while down, every
// transaction fails to begin, as with PostgreSQL unreachable.
type flakyDB struct {
	*pgtest.DB
	down atomic.Bool
}

func (f *flakyDB) Begin(ctx context.Context) (pgx.Tx, error) {
	if f.down.Load() {
		return nil, errors.New("dial tcp 127.0.0.1:5432: connect: connection refused")
	}
	return f.Pool.Begin(ctx)
}

func (f *flakyDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return f.Pool.Exec(ctx, sql, args...)
}

func (f *flakyDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return f.Pool.SendBatch(ctx, b)
}

// A database outage longer than the whole retry budget spends none of it:
// the batch waits in place (kept alive) and is applied once the database
// answers, with nothing retried, dead-lettered or out of order.
func TestEngineWaitsOutADatabaseOutage(t *testing.T) {
	t.Parallel()
	db := &flakyDB{DB: newDB(t)}
	fb := keepingBroker{&fakeBroker{keepGap: 20 * time.Millisecond}}
	e := newEngine(t, db, record, inbox.EngineConfig{MaxRetries: 1, InfraRetryMax: 50 * time.Millisecond,
		RetryDelay: func(int) time.Duration { return time.Millisecond }})
	db.down.Store(true)
	s := e.Start(context.Background(), fb, nil)
	for i := int64(1); i <= 3; i++ {
		s.Submit(recordOf(t, fmt.Sprint("a", i), ev("A", i)))
	}
	time.Sleep(500 * time.Millisecond) // ten times the budget of one 1ms retry
	if c := fb.taken(); len(c) != 0 {
		t.Fatalf("settled during the outage: %s", summary(c))
	}
	if fb.kept.Load() == 0 {
		t.Fatal("the records waiting out the outage were not kept alive")
	}
	db.down.Store(false)
	deadline := time.Now().Add(10 * time.Second)
	for len(effectsInOrder(t, db.DB)) < 3 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if left := s.Stop(true); len(left) != 0 {
		t.Fatalf("%d records unsettled", len(left))
	}
	if got := summary(fb.taken()); got != "ack a1; ack a2; ack a3" {
		t.Fatalf("after the outage: %s", got)
	}
	if got := strings.Join(effectsInOrder(t, db.DB), ","); got != "A/1,A/2,A/3" {
		t.Fatalf("effects %s", got)
	}
}

// A Lambda invocation stops starting records DeadlineMargin before its
// deadline: what it finished is settled, the rest goes back behind nothing
// newer of its group (parked, no failure counted), and handing them back
// again later applies each once.
func TestEngineStopsBeforeTheDeadline(t *testing.T) {
	t.Parallel()
	for _, ordered := range []bool{false, true} {
		t.Run(fmt.Sprintf("ordered-redelivery=%v", ordered), func(t *testing.T) {
			t.Parallel()
			db := newDB(t)
			fb := &fakeBroker{}
			slow := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
				time.Sleep(100 * time.Millisecond)
				return record(ctx, tx, e)
			}
			e := newEngine(t, db.Pool, slow, inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{DeadlineMargin: 300 * time.Millisecond},
				Lanes: 1, MaxRetries: 3, OrderedRedelivery: ordered})
			var recs []*inbox.Record
			for i := int64(1); i <= 20; i++ {
				recs = append(recs, recordOf(t, fmt.Sprint("a", i), ev("A", i)))
			}
			ctx, cancel := context.WithTimeout(context.Background(), 800*time.Millisecond)
			defer cancel()
			start := time.Now()
			if err := e.Handle(ctx, fb, recs); err != nil {
				t.Fatal(err)
			}
			if took := time.Since(start); took > 800*time.Millisecond {
				t.Fatalf("Handle took %s, past the deadline", took)
			}
			calls := fb.taken()
			acks := 0
			for i, c := range calls {
				if c.kind == "ack" {
					if i != acks {
						t.Fatalf("ack after a deferral: %s", summary(calls))
					}
					acks++
					continue
				}
				if c.kind != "retry" || c.retry.Failures != 0 {
					t.Fatalf("unfinished record settled as %s (failures %d)", c.kind, c.retry.Failures)
				}
			}
			if acks == 0 || acks == len(recs) || len(calls) != len(recs) {
				t.Fatalf("%d acks of %d calls for %d records: want some finished, the rest handed back", acks, len(calls), len(recs))
			}
			wantParked := 1
			if ordered {
				wantParked = 0 // the broker keeps the group back itself
			}
			if p := parkedRows(t, db); len(p) != wantParked || p["A"] != 0 {
				t.Fatalf("parks %v, want %d with no failures", p, wantParked)
			}
			// The event source redelivers what was handed back, in order.
			if err := e.Handle(context.Background(), fb, recs[acks:]); err != nil {
				t.Fatal(err)
			}
			for _, c := range fb.taken() {
				if c.kind != "ack" {
					t.Fatalf("redelivery settled %s", summary([]call{c}))
				}
			}
			effects := effectsInOrder(t, db)
			for i, s := range effects {
				if s != fmt.Sprintf("A/%d", i+1) {
					t.Fatalf("effects out of order or twice: %v", effects)
				}
			}
			if len(effects) != len(recs) {
				t.Fatalf("%d effects", len(effects))
			}
		})
	}
}

// A side effect that runs out of HandlerTimeout is its event's failure,
// even though the timeout broke the batch's transaction: the others of the
// batch are applied, and it is retried.
func TestEngineSideEffectTimeoutIsTheEventsFailure(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	fb := &fakeBroker{}
	a1, b1 := ev("A", 1), ev("B", 1)
	hang := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		if e.ID == a1.ID {
			_, err := tx.Exec(ctx, "SELECT pg_sleep(5)")
			return err
		}
		return record(ctx, tx, e)
	}
	e := newEngine(t, db.Pool, hang, inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{HandlerTimeout: 300 * time.Millisecond},
		Lanes: 1, MaxRetries: 3})
	if err := e.Handle(context.Background(), fb, []*inbox.Record{recordOf(t, "b1", b1), recordOf(t, "a1", a1)}); err != nil {
		t.Fatal(err)
	}
	if got := summary(fb.taken()); got != "ack b1; retry a1 n=1 failures=1" {
		t.Fatalf("settled %s", got)
	}
	if got := strings.Join(effectsInOrder(t, db), ","); got != "B/1" {
		t.Fatalf("effects %s", got)
	}
}

// With HoldDeferred (JetStream) a group's later events wait in memory,
// kept alive, while its head waits for a retry, and go once it is applied.
func TestEngineHoldsDeferredInMemory(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	fb := keepingBroker{&fakeBroker{keepGap: 10 * time.Millisecond}}
	f := &failing{}
	a1, a2, a3 := ev("A", 1), ev("A", 2), ev("A", 3)
	f.set(a1.ID, errors.New("busy"))
	var mu sync.Mutex
	var deferred []string
	e := newEngine(t, db.Pool, f.apply, inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{OnSettle: func(s inbox.Settlement) {
		if s.Action == inbox.ActionDeferred {
			mu.Lock()
			deferred = append(deferred, s.RecordID)
			mu.Unlock()
		}
	}}, MaxRetries: 3, HoldDeferred: true})
	s := e.Start(context.Background(), fb, nil)
	s.Submit(recordOf(t, "a1", a1))
	s.Submit(recordOf(t, "a2", a2))
	waitFor(t, func() bool { return fb.count() > 0 })
	s.Submit(recordOf(t, "a3", a3))
	time.Sleep(100 * time.Millisecond)
	if got := summary(fb.taken()); got != "retry a1 n=1 failures=1" {
		t.Fatalf("settled %s, want only a1's retry (a2, a3 held)", got)
	}
	if fb.kept.Load() == 0 {
		t.Fatal("held records not kept alive")
	}
	f.set(a1.ID, nil)
	s.Submit(recordOf(t, "a1", a1)) // the broker redelivers the head
	waitFor(t, func() bool { return len(effectsInOrder(t, db)) == 3 })
	if left := s.Stop(true); len(left) != 0 {
		t.Fatalf("%d left", len(left))
	}
	if got := summary(fb.taken()); got != "ack a1; ack a2; ack a3" {
		t.Fatalf("settled %s", got)
	}
	if got := strings.Join(effectsInOrder(t, db), ","); got != "A/1,A/2,A/3" {
		t.Fatalf("effects %s", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if strings.Join(deferred, ",") != "a2,a3" {
		t.Fatalf("deferred %v", deferred)
	}
}

// A broker that cannot settle a record fails the session: nothing after it
// is settled, and Handle says so (the event source redelivers the batch).
func TestEngineStopsSettlingWhenTheBrokerFails(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	fb := &fakeBroker{refuse: func(c call) error {
		if c.id == "a2" {
			return errors.New("channel closed")
		}
		return nil
	}}
	e := newEngine(t, db.Pool, record, inbox.EngineConfig{Lanes: 1})
	recs := []*inbox.Record{recordOf(t, "a1", ev("A", 1)), recordOf(t, "a2", ev("A", 2)), recordOf(t, "a3", ev("A", 3))}
	err := e.Handle(context.Background(), fb, recs)
	if err == nil || !strings.Contains(err.Error(), "channel closed") {
		t.Fatalf("Handle returned %v", err)
	}
	if got := summary(fb.taken()); got != "ack a1" {
		t.Fatalf("settled %s", got)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A record on its broker's last delivery (SQS: maxReceiveCount) holds its
// group before it runs, committed at once: while the database is down for
// the batch (or if the process died now) the hold already keeps the group
// behind it; once it is applied the hold goes, and a failure dead-letters
// it at once, whatever its retry budget.
func TestEnginePreHoldsALastDelivery(t *testing.T) {
	t.Parallel()
	db := &flakyDB{DB: newDB(t)}
	fb := &fakeBroker{}
	f := &failing{}
	e := newEngine(t, db, f.apply, inbox.EngineConfig{MaxRetries: 5, Lanes: 1, InfraRetryMax: 20 * time.Millisecond})
	a1, b1 := ev("A", 1), ev("B", 1)
	f.set(b1.ID, errors.New("busy"))
	last := func(id string, e envelope.Envelope) *inbox.Record {
		r := recordOf(t, id, e)
		r.LastDelivery = true
		return r
	}
	db.down.Store(true)
	s := e.Start(context.Background(), fb, nil)
	s.Submit(last("a1", a1))
	waitFor(t, func() bool { return len(heldRowsOf(t, db.DB)) == 1 })
	if h := heldRowsOf(t, db.DB); h[0] != "A:last-receive" {
		t.Fatalf("held %v before the batch ran, want A's pre-hold", h)
	}
	db.down.Store(false)
	s.Submit(last("b1", b1))
	waitFor(t, func() bool { return fb.count() == 2 })
	s.Stop(true)
	if got := summary(fb.taken()); got != "ack a1; dead b1 exhausted" {
		t.Fatalf("settled %s", got)
	}
	if h := strings.Join(heldRowsOf(t, db.DB), ","); h != "B:exhausted" {
		t.Fatalf("held rows %s, want A's pre-hold released and B held", h)
	}
}

// A crash is charged only to a record that ran alone: records redelivered
// after a consumer died mid-batch (no charge of theirs left) count no
// failure and each runs alone; a record whose solo attempt never reported
// (its charge still there, as a consumer killed by that event leaves it)
// counts one failure per such attempt, and once that spends its budget it
// is dead-lettered without being run again, its group held.
func TestEngineChargesACrashOnlyToARecordThatRanAlone(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	fb := &fakeBroker{}
	ctx := context.Background()
	var mu sync.Mutex
	var batches []int
	e := newEngine(t, &countingBatches{DB: db.Pool, mu: &mu, sizes: &batches}, record, inbox.EngineConfig{MaxRetries: 2, Lanes: 1})
	redelivered := func(id string, x envelope.Envelope) *inbox.Record {
		r := recordOf(t, id, x)
		r.Deliveries = 2
		return r
	}
	// Redelivered after a crash mid-batch: no failure counted, each alone.
	a1, a2, b1 := ev("A", 1), ev("A", 2), ev("B", 1)
	if err := e.Handle(ctx, fb, []*inbox.Record{redelivered("a1", a1), redelivered("a2", a2), redelivered("b1", b1)}); err != nil {
		t.Fatal(err)
	}
	if got := summary(fb.taken()); got != "ack a1; ack a2; ack b1" {
		t.Fatalf("redelivered after a crash mid-batch: %s", got)
	}
	mu.Lock()
	if fmt.Sprint(batches) != "[1 1 1]" {
		t.Errorf("batch transactions of %v records, want each redelivered record alone", batches)
	}
	mu.Unlock()
	if p := parkedRows(t, db); len(p) != 0 {
		t.Fatalf("charges left after their attempts reported: %v", p)
	}
	// P's event killed the consumer each time it ran alone: its charge is
	// still there when it comes back (two deaths, as committed before).
	p1, p2 := ev("P", 1), ev("P", 2)
	die := func() {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `UPDATE inbox_parked SET retry = 0 WHERE group_id = 'P'`); err != nil {
			t.Fatal(err)
		}
	}
	f := &failing{}
	f.set(p1.ID, errors.New("boom"))
	e = newEngine(t, db.Pool, f.apply, inbox.EngineConfig{MaxRetries: 2, Lanes: 1})
	// First delivery fails normally: 1 failure, retried.
	if err := e.Handle(ctx, fb, []*inbox.Record{recordOf(t, "p1", p1)}); err != nil {
		t.Fatal(err)
	}
	// Back, alone, and the consumer dies during it: simulated by its charge
	// staying (the attempt's own outcome is rolled back with the process).
	if got := summary(fb.taken()); got != "retry p1 n=1 failures=1" {
		t.Fatalf("first failure: %s", got)
	}
	die()
	if err := e.Handle(ctx, fb, []*inbox.Record{redelivered("p1", p1), redelivered("p2", p2)}); err != nil {
		t.Fatal(err)
	}
	// The death counted (2 failures), then this attempt failed: 3 > 2.
	if got := summary(fb.taken()); got != "dead p1 exhausted; dead p2 held" {
		t.Fatalf("after a death and a failure: %s", got)
	}
	if p := parkedRows(t, db); len(p) != 0 {
		t.Fatalf("parks left: %v", p)
	}
	// Q dies every time it runs alone: dead-lettered once its deaths
	// spend the budget, without running it again.
	q1 := ev("Q", 1)
	ran := 0
	e = newEngine(t, db.Pool, func(ctx context.Context, tx pgx.Tx, x envelope.Envelope) error {
		ran++
		return record(ctx, tx, x)
	}, inbox.EngineConfig{MaxRetries: 2, Lanes: 1})
	if _, err := db.Pool.Exec(ctx, `INSERT INTO inbox_parked (consumer, group_id, message_key, event_id, sequence, failures, retry, due_at, expires_at)
VALUES ('c', 'Q', $1, $2, 1, 2, 0, now(), now() + interval '1 hour')`, q1.ID, q1.ID); err != nil {
		t.Fatal(err)
	}
	if err := e.Handle(ctx, fb, []*inbox.Record{redelivered("q1", q1)}); err != nil {
		t.Fatal(err)
	}
	if got := summary(fb.taken()); got != "dead q1 exhausted" || ran != 0 {
		t.Fatalf("a record whose solo attempts died 3 times: %s, ran %d times; want dead-lettered without running", got, ran)
	}
	if h := heldRowsOf(t, db); strings.Join(h, ",") != "P:exhausted,P:held,Q:exhausted" {
		t.Fatalf("held rows %v", h)
	}
}

// countingBatches records the size of each batch transaction: how many
// inbox claims it made.
type countingBatches struct {
	inbox.DB
	mu    *sync.Mutex
	sizes *[]int
}

func (c *countingBatches) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := c.DB.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &claimCountingTx{Tx: tx, c: c}, nil
}

type claimCountingTx struct {
	pgx.Tx
	c      *countingBatches
	claims int
}

func (t *claimCountingTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	for _, q := range b.QueuedQueries {
		if strings.HasPrefix(q.SQL, `INSERT INTO "inbox" (`) {
			t.claims++
		}
	}
	return t.Tx.SendBatch(ctx, b)
}

func (t *claimCountingTx) Commit(ctx context.Context) error {
	if t.claims > 0 {
		t.c.mu.Lock()
		*t.c.sizes = append(*t.c.sizes, t.claims)
		t.c.mu.Unlock()
	}
	return t.Tx.Commit(ctx)
}

// An event applied before, delivered again while its group is held (a
// replay, a late copy), is a duplicate: acknowledged, not sent to the DLQ
// behind the hold, wherever it stands in the batch.
func TestEngineAcksADuplicateOfAHeldGroup(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	fb := &fakeBroker{}
	f := &failing{}
	a1, a2, a3 := ev("A", 1), ev("A", 2), ev("A", 3)
	f.set(a2.ID, envelope.Permanent(errors.New("rejected")))
	e := newEngine(t, db.Pool, f.apply, inbox.EngineConfig{Lanes: 1})
	ctx := context.Background()
	if err := e.Handle(ctx, fb, []*inbox.Record{recordOf(t, "a1", a1), recordOf(t, "a2", a2)}); err != nil {
		t.Fatal(err)
	}
	if got := summary(fb.taken()); got != "ack a1; dead a2 permanent" {
		t.Fatalf("first batch: %s", got)
	}
	for _, batch := range [][]*inbox.Record{
		{recordOf(t, "a3", a3), recordOf(t, "a1-again", a1)},         // the copy second
		{recordOf(t, "a1-again-2", a1), recordOf(t, "a3-again", a3)}, // the copy first
	} {
		if err := e.Handle(ctx, fb, batch); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := summary(fb.taken()), "dead a3 held; ack a1-again; ack a1-again-2; dead a3-again held"; got != want {
		t.Fatalf("copies of an applied event in a held group: %s, want %s", got, want)
	}
	if h := heldRowsOf(t, db); strings.Join(h, ",") != "A:permanent,A:held" {
		t.Fatalf("held rows %v, want A/2 and A/3 only", h)
	}
}
