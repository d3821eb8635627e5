package nats_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
)

// privateServer starts a nats-server of the test's own (the machine's one on
// 4222 runs without auth and is left alone) on a free loopback port, with
// JetStream and config's extra settings, and stops it when the test ends.
func privateServer(t *testing.T, config string) string {
	t.Helper()
	bin, err := exec.LookPath("nats-server")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/nats-server"); serr != nil {
			t.Skip("no nats-server binary (scripts/ensure-natsgo.sh installs it)")
		}
		bin = "/usr/sbin/nats-server"
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	dir := t.TempDir()
	conf := filepath.Join(dir, "server.conf")
	body := fmt.Sprintf("listen: \"127.0.0.1:%d\"\njetstream: {store_dir: %q}\n%s\n", port, filepath.Join(dir, "js"), config)
	if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-c", conf)
	logf, _ := os.Create(filepath.Join(dir, "server.log"))
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	for i := 0; ; i++ {
		if c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond); err == nil {
			c.Close()
			break
		}
		if i > 100 {
			b, _ := os.ReadFile(filepath.Join(dir, "server.log"))
			t.Fatalf("private nats-server did not start: %s", b)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return "nats://" + addr
}

// violations records the permission errors the server reports to one connection.
type violations struct {
	mu   sync.Mutex
	errs []string
}

func (v *violations) handler(_ *natsgo.Conn, _ *natsgo.Subscription, err error) {
	if errors.Is(err, natsgo.ErrPermissionViolation) || strings.Contains(strings.ToLower(err.Error()), "permissions violation") {
		v.mu.Lock()
		v.errs = append(v.errs, err.Error())
		v.mu.Unlock()
	}
}

func (v *violations) on(subject string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, e := range v.errs {
		if strings.Contains(e, `"`+subject+`"`) {
			return true
		}
	}
	return false
}

// TestEachFunctionsNATSUserCanDoOnlyItsJob runs the ticketing topology on a
// private nats-server configured with Topology.AuthorizationConfig's users,
// runs each function's real code as its user (provisioning, the publisher,
// a consumer runner dead-lettering an event, operations redriving it), and
// then tries, as each user, what it must not do: the server refuses it
// (a permissions violation for exactly that subject).
func TestEachFunctionsNATSUserCanDoOnlyItsJob(t *testing.T) {
	t.Parallel()
	topo := nats.Ticketing()
	if err := topo.Prepare(); err != nil {
		t.Fatal(err)
	}
	users := []nats.User{
		{Name: "provisioner", Password: "p-pw", Role: nats.RoleProvisioner},
		{Name: "dispatcher", Password: "d-pw", Role: nats.RoleDispatcher},
		{Name: "operations", Password: "o-pw", Role: nats.RoleOperations},
		{Name: "inventory", Password: "i-pw", Role: nats.RoleConsumer, Consumer: "inventory"},
		{Name: "notification", Password: "n-pw", Role: nats.RoleConsumer, Consumer: "notification"},
	}
	auth, err := topo.AuthorizationConfig(users)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(auth, "d-pw") {
		t.Fatal("the authorization block holds a plain password")
	}
	url := privateServer(t, auth)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfgAs := func(user string) nats.Config {
		for _, u := range users {
			if u.Name == user {
				return nats.Config{URL: url, Topology: topo, User: u.Name, Password: u.Password, Logger: quiet,
					ConnectWait: 2 * time.Second, AckTimeout: 2 * time.Second, ReconnectMaxDelay: 500 * time.Millisecond}
			}
		}
		t.Fatalf("no user %s", user)
		return nats.Config{}
	}
	// Without credentials the server refuses the connection.
	if nc, err := natsgo.Connect(url, natsgo.Timeout(2*time.Second)); err == nil {
		nc.Close()
		t.Fatal("an anonymous connection was accepted")
	}

	// Allowed: each function's own code path, as its user.
	p, err := nats.NewProvisioner(cfgAs("provisioner"))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Provision(ctx); err != nil {
		t.Fatalf("provision as the provisioner: %v", err)
	}
	pub := newPublisher(t, cfgAs("dispatcher"))
	good := message(newEvent("hold", "h-1", "hold_created", 1))
	bad := message(newEvent("hold", "h-2", "hold_created", 1))
	if errs := pub.Publish(ctx, []outbox.Message{good, bad}); errs[0] != nil || errs[1] != nil {
		t.Fatalf("publish as the dispatcher: %v", errs)
	}
	db := pgtest.New(t)
	dead := make(chan struct{}, 1)
	r, err := nats.NewRunner(cfgAs("inventory"), db.Pool, func(_ context.Context, _ pgx.Tx, e envelope.Envelope) error {
		if e.ID == bad.EventID {
			return envelope.Permanent(errors.New("unknown venue"))
		}
		return nil
	}, inbox.ConsumerConfig{Consumer: "inventory", OnSettle: func(s inbox.Settlement) {
		if s.EventID == bad.EventID && s.Action == inbox.ActionDeadLetter {
			dead <- struct{}{}
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	select {
	case <-dead:
	case err := <-done:
		t.Fatalf("the runner as inventory stopped: %v", err)
	case <-ctx.Done():
		t.Fatal("the runner as inventory did not dead-letter the failing event")
	}
	stop()
	<-done
	ops, err := nats.NewOperations(cfgAs("operations"))
	if err != nil {
		t.Fatal(err)
	}
	defer ops.Close()
	depths, err := ops.Depths(ctx)
	if err != nil {
		t.Fatalf("depths as operations: %v", err)
	}
	for _, d := range depths {
		if d.Error != "" {
			t.Errorf("depths as operations: %s: %s", d.Consumer, d.Error)
		}
	}
	if res, err := ops.Redrive(ctx, transport.RedriveRequest{Consumer: "inventory", Max: 10}); err != nil || res.Moved != 1 {
		t.Fatalf("redrive as operations: %+v, %v; want the dead letter", res, err)
	}

	// Refused: what each must not do.
	inv, note := topo.Consumers[0], topo.Consumers[1]
	type op struct {
		subject string
		run     func(nc *natsgo.Conn, js jetstream.JetStream) error
	}
	pubOp := func(subj string) op {
		return op{subj, func(nc *natsgo.Conn, _ jetstream.JetStream) error {
			if err := nc.Publish(subj, []byte("{}")); err != nil {
				return err
			}
			return nc.Flush()
		}}
	}
	reqOp := func(subj string) op {
		return op{subj, func(nc *natsgo.Conn, _ jetstream.JetStream) error {
			_, err := nc.Request(subj, nil, 500*time.Millisecond)
			return err
		}}
	}
	subOp := func(subj string) op {
		return op{subj, func(nc *natsgo.Conn, _ jetstream.JetStream) error {
			if _, err := nc.SubscribeSync(subj); err != nil {
				return err
			}
			return nc.Flush()
		}}
	}
	api := "$JS.API."
	refused := map[string][]op{
		"dispatcher": {pubOp(topo.DLQSubject(inv)), subOp(topo.SubjectPrefix + ".>"), reqOp(api + "STREAM.DELETE." + topo.Stream),
			reqOp(api + "CONSUMER.MSG.NEXT." + topo.Stream + "." + inv.Durable()), subOp("_INBOX.inventory.>")},
		"inventory": {reqOp(api + "CONSUMER.MSG.NEXT." + topo.Stream + "." + note.Durable()), pubOp(topo.DLQSubject(note)),
			pubOp(topo.SubjectPrefix + ".order_confirmed"), reqOp(api + "STREAM.PURGE." + topo.Stream), reqOp(api + "STREAM.MSG.DELETE." + topo.DeadLetterStream),
			pubOp(topo.ReplaySubjectPrefix(note) + ".order_confirmed"), subOp(topo.SubjectPrefix + ".>"), subOp("_INBOX.notification.>")},
		"operations": {pubOp(topo.SubjectPrefix + ".order_confirmed"), reqOp(api + "CONSUMER.DELETE." + topo.Stream + "." + inv.Durable()),
			reqOp(api + "STREAM.DELETE." + topo.DeadLetterStream), reqOp(api + "CONSUMER.MSG.NEXT." + topo.Stream + "." + inv.Durable()),
			reqOp(api + "STREAM.CREATE.EVIL")},
	}
	for user, ops := range refused {
		v := &violations{}
		c := cfgAs(user)
		nc, err := natsgo.Connect(url, natsgo.UserInfo(c.User, c.Password), natsgo.CustomInboxPrefix(nats.InboxPrefix(user)), natsgo.ErrorHandler(v.handler))
		if err != nil {
			t.Fatalf("%s: connect: %v", user, err)
		}
		for _, o := range ops {
			_ = o.run(nc, nil)
			deadline := time.Now().Add(3 * time.Second)
			for !v.on(o.subject) && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			if !v.on(o.subject) {
				t.Errorf("%s may use %s: no permissions violation", user, o.subject)
			}
		}
		nc.Close()
	}
	// And the dead letter went back to inventory's replay subject, nowhere else.
	admin := cfgAs("provisioner")
	nc, err := natsgo.Connect(url, natsgo.UserInfo(admin.User, admin.Password), natsgo.CustomInboxPrefix(nats.InboxPrefix("provisioner")))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	s, err := js.Stream(ctx, topo.Stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(topo.ReplaySubjectPrefix(inv)+".>"))
	if err != nil || len(info.State.Subjects) != 1 {
		t.Fatalf("replay subjects after redrive: %v %v, want inventory's one", info, err)
	}
}

func TestNATSPermissionsNameOnlyTheTopologysSubjects(t *testing.T) {
	topo := nats.Ticketing()
	if err := topo.Prepare(); err != nil {
		t.Fatal(err)
	}
	p, err := topo.Permissions(nats.RoleConsumer, "inventory", "inv-user")
	if err != nil {
		t.Fatal(err)
	}
	all := strings.Join(append(p.Publish, p.Subscribe...), " ")
	for _, s := range []string{"notification", "ticketing.>", "STREAM.DELETE", "CONSUMER.DELETE", "_INBOX.>"} {
		if strings.Contains(all, s) {
			t.Errorf("consumer inventory's permissions %q name %s", all, s)
		}
	}
	if p.Subscribe[0] != "_INBOX.inv-user.>" {
		t.Errorf("subscribe %v, want its own inbox", p.Subscribe)
	}
	if _, err := topo.Permissions(nats.RoleConsumer, "nobody", "x"); err == nil {
		t.Error("permissions for a consumer not in the topology")
	}
	if _, err := topo.Permissions("admin", "", "x"); err == nil {
		t.Error("permissions for an unknown role")
	}
	if nats.InboxPrefix("a.b") != "_INBOX" || nats.InboxPrefix("fifobox-dispatcher") != "_INBOX.fifobox-dispatcher" {
		t.Error("InboxPrefix")
	}
}
