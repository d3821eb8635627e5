package nats_test

import (
	"bufio"
	"context"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
)

// TestLostDeliveryRedeliveredInOrder: the server sends an aggregate's third
// event and it never reaches the runner (as when the connection is cut with
// it on the wire), while the fourth and later ones do. The runner must not
// apply or acknowledge anything after the gap: it resumes when the lost
// delivery and those after it come back together after AckWait, and applies
// all eight in order, each once. Without the consumer-sequence check the
// later events are applied first and the lost one last.
func TestLostDeliveryRedeliveredInOrder(t *testing.T) {
	t.Parallel()
	const n, lost = 8, 3 // stream sequences 1..n; the first delivery of `lost` is dropped
	cfg := setup(t, nats.Topology{Stream: "LOST", SubjectPrefix: "lost", Consumers: []nats.Consumer{{
		Name: "c", Filters: []string{">"}, AckWait: transport.Duration(2 * time.Second),
		Retry: fastRetry(3)}}})
	evs := make([]envelope.Envelope, n)
	msgs := make([]outbox.Message, n)
	for i := range evs {
		evs[i] = newEvent("order", "o-1", "changed", int64(i+1))
		msgs[i] = message(evs[i])
	}
	// Published before the runner starts: one pull brings them all, in one
	// batch, so the later ones are in hand as the gap appears.
	for i, err := range newPublisher(t, cfg).Publish(context.Background(), msgs) {
		if err != nil {
			t.Fatalf("publish %d: %v", i+1, err)
		}
	}

	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (n bigserial PRIMARY KEY, event_id uuid, seq bigint)`); err != nil {
		t.Fatal(err)
	}
	apply := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		_, err := tx.Exec(ctx, `INSERT INTO applied (event_id, seq) VALUES ($1, $2)`, e.ID, e.Sequence)
		return err
	}
	px := newWireProxy(t, cfg.Topology.Stream, lost)
	rcfg := cfg
	rcfg.URL = px.URL()
	r, err := nats.NewRunner(rcfg, db.Pool, apply, inbox.ConsumerConfig{Consumer: "c"})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(rctx) }()
	t.Cleanup(func() { cancel(); <-done })

	seqs := func() []int64 {
		rows, err := db.Pool.Query(ctx, `SELECT seq FROM applied ORDER BY n`)
		if err != nil {
			t.Fatal(err)
		}
		s, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	eventually(t, 15*time.Second, "eight events applied", func() bool { return len(seqs()) >= n })
	if !px.wasDropped() {
		t.Fatal("the proxy dropped nothing: the test did not lose a delivery")
	}
	time.Sleep(300 * time.Millisecond) // a late duplicate would show now
	got := seqs()
	if len(got) != n {
		t.Fatalf("applied %v, want 1..%d once each", got, n)
	}
	for i, s := range got {
		if s != int64(i+1) {
			t.Fatalf("applied %v, want 1..%d in order", got, n)
		}
	}
	// What the runner acknowledged, in the order it sent it: each stream
	// sequence's first +ACK must come after those of the ones before it.
	var order []uint64
	seen := map[uint64]bool{}
	for _, a := range px.acks() {
		if a.kind == "+ACK" && !seen[a.seq] {
			seen[a.seq] = true
			order = append(order, a.seq)
		}
	}
	if len(order) != n {
		t.Fatalf("acknowledged stream sequences %v, want 1..%d", order, n)
	}
	for i, s := range order {
		if s != uint64(i+1) {
			t.Fatalf("acknowledged stream sequences in the order %v, want 1..%d", order, n)
		}
	}
	for _, a := range px.acks() {
		if a.seq > lost && a.kind == "-NAK" {
			t.Errorf("stream sequence %d nacked (it would come back before the lost one): %v", a.seq, px.acks())
		}
	}
}

// wireProxy forwards the NATS protocol between the runner and the server,
// frame by frame. It drops the first delivery of one stream sequence of one
// stream (server to client) and records every acknowledgement the client
// sends for that stream.
type wireProxy struct {
	ln     net.Listener
	target string
	stream string
	drop   uint64

	mu      sync.Mutex
	dropped bool
	acked   []wireAck
	conns   []net.Conn
}

// wireAck is one acknowledgement as sent: its stream sequence and its
// kind ("+ACK", "-NAK", "+WPI", "+TERM").
type wireAck struct {
	seq  uint64
	kind string
}

func newWireProxy(tb testing.TB, stream string, drop uint64) *wireProxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &wireProxy{ln: ln, target: strings.TrimPrefix(serverURL(), "nats://"), stream: stream, drop: drop}
	go p.accept()
	tb.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, c := range p.conns {
			_ = c.Close()
		}
	})
	return p
}

func (p *wireProxy) URL() string { return "nats://" + p.ln.Addr().String() }

func (p *wireProxy) wasDropped() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dropped
}

func (p *wireProxy) acks() []wireAck {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]wireAck(nil), p.acked...)
}

func (p *wireProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.DialTimeout("tcp", p.target, 2*time.Second)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		go p.frames(c, s, p.fromServer)
		go p.frames(s, c, p.fromClient)
	}
}

// frames copies src to dst one protocol frame (a control line and its
// payload, if any) at a time, forwarding those keep approves.
func (p *wireProxy) frames(dst, src net.Conn, keep func(op []string, payload []byte) bool) {
	defer dst.Close()
	defer src.Close()
	in, out := bufio.NewReader(src), bufio.NewWriter(dst)
	for {
		line, err := in.ReadString('\n')
		if err != nil {
			return
		}
		op := strings.Fields(line)
		var payload []byte
		if len(op) > 0 {
			switch strings.ToUpper(op[0]) {
			case "MSG", "HMSG", "PUB", "HPUB": // the last argument is the payload's size
				size, err := strconv.Atoi(op[len(op)-1])
				if err != nil {
					return
				}
				payload = make([]byte, size+2) // and its CRLF
				if _, err := io.ReadFull(in, payload); err != nil {
					return
				}
			}
		}
		if keep(op, payload) {
			_, _ = out.WriteString(line)
			_, _ = out.Write(payload)
		}
		if in.Buffered() == 0 {
			if err := out.Flush(); err != nil {
				return
			}
		}
	}
}

// fromServer drops the first delivery of the chosen stream sequence.
func (p *wireProxy) fromServer(op []string, _ []byte) bool {
	if len(op) < 5 || (op[0] != "MSG" && op[0] != "HMSG") {
		return true
	}
	reply := op[3] // MSG <subject> <sid> <reply> ..., when there is a reply subject
	stream, delivered, seq, ok := ackSubject(reply)
	if !ok || stream != p.stream || seq != p.drop || delivered != 1 {
		return true
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dropped {
		return true
	}
	p.dropped = true
	return false
}

// fromClient records the acknowledgements of the stream's messages.
func (p *wireProxy) fromClient(op []string, payload []byte) bool {
	if len(op) < 3 || op[0] != "PUB" {
		return true
	}
	stream, _, seq, ok := ackSubject(op[1])
	if !ok || stream != p.stream {
		return true
	}
	kind := strings.Fields(string(payload))
	a := wireAck{seq: seq, kind: "+ACK"} // an empty body acknowledges too
	if len(kind) > 0 {
		a.kind = kind[0]
	}
	p.mu.Lock()
	p.acked = append(p.acked, a)
	p.mu.Unlock()
	return true
}

// ackSubject reads a JetStream delivery's reply subject:
// $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>,
// or its newer form with domain and account hash after "$JS.ACK".
func ackSubject(s string) (stream string, delivered, seq uint64, ok bool) {
	t := strings.Split(s, ".")
	if len(t) < 9 || t[0] != "$JS" || t[1] != "ACK" {
		return "", 0, 0, false
	}
	if len(t) >= 12 {
		t = t[2:]
	}
	d, err1 := strconv.ParseUint(t[4], 10, 64)
	q, err2 := strconv.ParseUint(t[5], 10, 64)
	return t[2], d, q, err1 == nil && err2 == nil
}
