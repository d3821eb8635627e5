package nats_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/wire"
)

// A publisher with a profile publishes on the profile's subject (a dotted
// event type stays as it is) into the profile's stream, with its headers
// and Nats-Msg-Id; an event on a subject the stream does not capture is
// the unrouted one (delivered and reported under the deliver policy).
func TestProfilePublisher(t *testing.T) {
	t.Parallel()
	needServer(t)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	p, err := wire.Parse([]byte(fmt.Sprintf(`{"name":"p","event_id_format":"ulid","body":{"id":"{event_id}","data":"{payload}"},
		"nats":{"subject":"t%[1]s.{event_type}","headers":{"tenant-id":"{tenant_id}"},"stream":{"name":"T%[1]s","subjects":["t%[1]s.order.>"]}}}`, id)))
	if err != nil {
		t.Fatal(err)
	}
	m, err := p.Mapper(wire.TransportNATS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		nc, err := natsgo.Connect(serverURL())
		if err != nil {
			return
		}
		defer nc.Close()
		js, _ := jetstream.New(nc)
		_ = js.DeleteStream(context.Background(), "T"+id)
	})
	cfg := nats.Config{URL: serverURL(), Topology: isolate(t, nats.Holdco()), Wire: m, Logger: quiet}
	prov, err := nats.NewProfileProvisioner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := prov.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	pub := newPublisher(t, cfg)
	in, out := newEvent("order", "o-1", "order.created", 1), newEvent("invoice", "i-1", "invoice.paid", 1)
	for i, err := range pub.Publish(ctx, []outbox.Message{message(in), message(out)}) {
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	if st := pub.Stats(); st.Stored != 1 || st.Unrouted != 1 {
		t.Errorf("stats %+v, want 1 stored and 1 unrouted", st)
	}
	msgs := dialRaw(t).all("T"+id, ">")
	if len(msgs) != 1 {
		t.Fatalf("%d messages in the profile's stream", len(msgs))
	}
	got := msgs[0]
	if got.Subject() != "t"+id+".order.created" || got.Headers().Get("Nats-Msg-Id") != wire.ULID.Format(in.ID) ||
		got.Headers().Get("tenant-id") != "acme" || string(got.Data()) != `{"id":"`+wire.ULID.Format(in.ID)+`","data":`+string(in.Payload)+`}` {
		t.Errorf("subject %q headers %v data %s", got.Subject(), got.Headers(), got.Data())
	}
}
