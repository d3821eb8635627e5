package amqp_test

import (
	"context"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

// The provisioning function reads each function's broker user from its own
// secret (FIFOBOX_AMQP_USER_SECRETS); a bad entry fails naming the variable
// and the role, never a value.
func TestOpenReadsTheFunctionsUsers(t *testing.T) {
	secrets := map[string]string{
		"arn:admin": `{"username":"fifobox","password":"admin-pw"}`,
		"arn:d":     `{"username":"fifobox-dispatcher","password":"d-pw"}`,
		"arn:o":     `{"username":"fifobox-operations","password":"o-pw"}`,
		"arn:c":     `{"username":"fifobox-consumer-inventory","password":"c-pw"}`,
		"arn:bad":   `{"username":"x"}`,
	}
	fetch := func(_ context.Context, arn string) (string, error) { return secrets[arn], nil }
	open := func(t *testing.T, users string) (*amqp.Transport, error) {
		clearTransportEnv(t)
		t.Setenv("FIFOBOX_TRANSPORT", "rabbitmq")
		t.Setenv("FIFOBOX_AMQP_TOPOLOGY", "ticketing")
		t.Setenv("FIFOBOX_AMQP_URL", "amqps://b-1.mq.us-east-1.amazonaws.com:5671/prod")
		t.Setenv("FIFOBOX_AMQP_SECRET_ARN", "arn:admin")
		t.Setenv(amqp.EnvUserSecrets, users)
		tr, err := transport.Open(context.Background(), transport.Options{Secret: fetch})
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { _ = tr.Close() })
		return tr.(*amqp.Transport), nil
	}
	tr, err := open(t, `{"dispatcher":"arn:d","operations":"arn:o","consumer:inventory":"arn:c"}`)
	if err != nil {
		t.Fatal(err)
	}
	want := []amqp.User{
		{Name: "fifobox-consumer-inventory", Password: "c-pw", Role: amqp.RoleConsumer, Consumer: "inventory"},
		{Name: "fifobox-dispatcher", Password: "d-pw", Role: amqp.RoleDispatcher},
		{Name: "fifobox-operations", Password: "o-pw", Role: amqp.RoleOperations},
	}
	got := tr.Config().Users
	if len(got) != len(want) {
		t.Fatalf("users %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("user %d: %v, want %v", i, got[i], want[i])
		}
	}
	for _, bad := range []string{`{"admin":"arn:d"}`, `{"consumer:nobody":"arn:c"}`, `{"dispatcher":"arn:bad"}`, `[1]`} {
		_, err := open(t, bad)
		if err == nil || !strings.Contains(err.Error(), amqp.EnvUserSecrets) || strings.Contains(err.Error(), "-pw") {
			t.Errorf("%s: %v, want an error naming %s and no password", bad, err, amqp.EnvUserSecrets)
		}
	}
}
